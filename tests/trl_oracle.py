"""TRL 1.16's GRPOTrainer._compute_loss as the oracle of the loss (test_loss_trl's docstring tells
how): the trainer built without its __init__, random generation batches, one optimizer step
through TRL and the same step through grpo_jax.grpo.train_step.accumulate. Shared by
test_loss_trl, test_metrics_trl and test_moe."""

import dataclasses
import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

from grpo_jax.grpo import loss as L  # noqa: E402
from grpo_jax.grpo.batch import Batch  # noqa: E402
from grpo_jax.grpo.train_step import StepConfig, accumulate  # noqa: E402

T = 7  # completion tokens per row


class FakeAccelerator:
    """One process: every collective is the identity."""
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_trainer(cfg: L.LossConfig, k: int, spg: int, use_vllm: bool):
    """A GRPOTrainer with just what _compute_loss reads, set as TRL's __init__ sets it."""
    t = object.__new__(trl_grpo.GRPOTrainer)
    names = [f.name for f in dataclasses.fields(L.LossConfig)]
    t.args = SimpleNamespace(**{n: getattr(cfg, n) for n in names}, steps_per_generation=spg)
    t.loss_type, t.beta = cfg.loss_type, cfg.beta
    t.epsilon_low, t.epsilon_high = cfg.epsilon, cfg.eps_high
    t.importance_sampling_level = cfg.importance_sampling_level
    t.top_entropy_quantile = cfg.top_entropy_quantile
    t.off_policy_mask_threshold = cfg.off_policy_mask_threshold
    t.use_vllm = use_vllm
    t.vllm_importance_sampling_correction = cfg.vllm_importance_sampling_correction
    t.max_completion_length = T
    t.current_gradient_accumulation_steps = k
    t.accelerator = FakeAccelerator()
    t.model = SimpleNamespace(training=True)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.aux_loss_enabled = False
    t.entropy_coef = cfg.entropy_coef
    t.use_adaptive_entropy = cfg.use_adaptive_entropy
    t._entropy_bonus_enabled = cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy
    t._last_world_entropy = float("inf")
    t._entropy_window_stats = None
    return t


def trl_is_ratio(old, sampling, mask, cfg: L.LossConfig):
    """TRL 1.16 _generate_and_score_completions' vllm_importance_sampling_ratio."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if cfg.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    r = torch.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("_truncate"):
        return torch.clamp(r, min=lo, max=hi)
    lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
    return r.masked_fill((r < lo) | (r > hi), 0.0)


def make_inputs(seed, n, noise=0.3, entropy_scale=3.0):
    """A generation batch of n rows: an empty completion, a truncated one, a zero advantage."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, n)
    lengths[1], lengths[2] = 0, T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)
    logp = -3.0 * rng.random((n, T))
    f = lambda s: s * rng.standard_normal((n, T))  # noqa: E731
    x = dict(logp=logp, old_logp=logp + f(noise), ref_logp=logp + f(0.2),
             sampler_logp=logp + f(noise), advantages=rng.standard_normal(n),
             entropy=entropy_scale * rng.random((n, T)), completion_mask=mask,
             truncated=lengths == T)
    x["advantages"][3] = 0.0
    return {k: np.asarray(v, np.float32) if v.dtype == np.float64 else v for k, v in x.items()}


def run_trl(t, x, cfg, k, rows, old, sampler, num_items):
    """One optimizer step over rows [0, rows) of x in k micro-batches; returns (loss, grad logp,
    grad entropy) as float64 numpy."""
    d = lambda a: torch.tensor(np.asarray(a, np.float64))  # noqa: E731
    logp = d(x["logp"][:rows]).requires_grad_(True)
    entropy = d(x["entropy"][:rows]).requires_grad_(True)
    # TRL masks truncated completions at generation time, in completion_mask itself.
    mask_np = x["completion_mask"] * (1 - (x["truncated"] & cfg.mask_truncated_completions)[:, None])
    mask = torch.tensor(mask_np[:rows])
    size = rows // k
    total = 0.0
    for j in range(k):
        sl = slice(j * size, (j + 1) * size)
        lp, ent = logp[sl], entropy[sl]
        t._get_per_token_logps_and_entropies = (
            lambda *a, _lp=lp, _ent=ent, **kw: (_lp, _ent, None))
        inputs = {"prompt_ids": torch.zeros((size, 2), dtype=torch.long),
                  "prompt_mask": torch.ones((size, 2), dtype=torch.long),
                  "completion_ids": torch.zeros((size, T), dtype=torch.long),
                  "completion_mask": mask[sl], "advantages": d(x["advantages"][:rows][sl]),
                  "num_items_in_batch": torch.tensor(float(num_items), dtype=torch.float64)}
        old_t = d(x["old_logp"][:rows][sl]) if old else None
        if cfg.beta:
            inputs["ref_per_token_logps"] = d(x["ref_logp"][:rows][sl])
        if sampler:  # TRL: vLLM generated, so it always has the old log-probs
            samp = d(x["sampler_logp"][:rows][sl])
            inputs["sampling_per_token_logps"] = samp
            if cfg.vllm_importance_sampling_correction:
                old_t = lp.detach().clone() if old_t is None else old_t
                inputs["importance_sampling_ratio"] = trl_is_ratio(old_t, samp, mask[sl], cfg)
        if old_t is not None:
            inputs["old_per_token_logps"] = old_t
        t.accelerator.sync_gradients = j == k - 1
        loss = t._compute_loss(None, inputs)
        loss.backward()
        total += float(loss.detach())
    g = lambda v: np.zeros(v.shape) if v.grad is None else v.grad.numpy()  # noqa: E731
    return total, g(logp), g(entropy)


def jax_step(x, cfg, k, rows, old, sampler, num_items, entropy_coef=None):
    """The same step through train_step.accumulate: (loss, grad logp, grad entropy, sums)."""
    get = lambda name: jnp.asarray(x[name][:rows])  # noqa: E731
    batch = Batch(prompt_ids=None, prompt_mask=None, completion_ids=None,
                  completion_mask=get("completion_mask").astype(jnp.int32),
                  truncated=get("truncated"), advantages=get("advantages"),
                  old_logp=get("old_logp") if old else None,
                  ref_logp=get("ref_logp") if cfg.beta else None,
                  sampler_logp=get("sampler_logp") if sampler else None,
                  num_items=None if num_items is None else jnp.asarray(num_items[:rows]))
    size = rows // k

    def micro_loss(params, mb, j):
        lp, ent = (jax.lax.dynamic_slice_in_dim(p, j * size, size) for p in params)
        return L.micro_loss_terms(lp, ent, mb, cfg)

    step_cfg = StepConfig(loss=cfg, temperature=1.0, gradient_accumulation_steps=k)
    loss, (g_lp, g_ent), sums = jax.jit(
        lambda p: accumulate(micro_loss, step_cfg, p, batch, entropy_coef=entropy_coef))(
        (get("logp"), get("entropy")))
    return float(loss), np.asarray(g_lp), np.asarray(g_ent), sums


def trl_sampling_metrics(old, sampling, mask, cfg: L.LossConfig) -> dict:
    """TRL 1.16 _generate_and_score_completions' sampling/* metrics of one generation batch on
    one process (its lines re-derived, as trl_is_ratio: they are inline there)."""
    d = lambda a: torch.tensor(np.asarray(a, np.float64))  # noqa: E731
    old, sampling, mask = d(old), d(sampling), d(mask)
    ratio = trl_is_ratio(old, sampling, mask, cfg)
    delta = torch.abs(old - sampling)
    mask = mask.bool()
    delta = delta[mask & ~torch.isnan(delta)]
    zero = torch.tensor(0.0, dtype=torch.float64)
    flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask]
    pick = lambda f, x: f(x) if x.numel() > 0 else zero  # noqa: E731
    name = "sampling/importance_sampling_ratio/"
    return {"sampling/sampling_logp_difference/mean": float(pick(torch.mean, delta)),
            "sampling/sampling_logp_difference/max": float(pick(torch.max, delta)),
            name + "min": float(pick(torch.min, flat)), name + "mean": float(pick(torch.mean, flat)),
            name + "max": float(pick(torch.max, flat))}
