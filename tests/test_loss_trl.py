"""grpo-jax's loss against TRL 1.16's own GRPOTrainer._compute_loss.

TRL's trainer is built without its __init__ (object.__new__) and given the attributes that
_compute_loss reads; its _get_per_token_logps_and_entropies is replaced by one that returns given
float64 log-probs and entropies (leaf tensors that require grad). Each case runs one optimizer
step of k micro-batches through TRL (the sum of _compute_loss's values, which TRL has already
scaled for accumulation, with the gradients accumulated in the leaves) and through
grpo_jax.grpo.train_step.accumulate in float32 with the same log-probs and entropies as the
parameters. Compared: the loss, its gradient w.r.t. every log-prob and entropy, and every metric
both log, micro-batch by micro-batch (TRL appends one value per micro-batch to its buffer;
loss.step_metrics gives the same list). The contract is 1e-5, relative to max(1, |TRL's value|)
(gradients: to max(1, max |TRL's gradient|)). Measured over all cases (relative to that scale):
loss 1.4e-7, d/d logp 2e-8, d/d entropy 2e-10, metrics <= 1.1e-7 (clip fractions exactly equal).

The vLLM importance-sampling ratio is an input of _compute_loss that TRL computes in
_generate_and_score_completions (inline, not a function we can call): `trl_is_ratio` re-derives it
from those lines.
"""

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
from trl import GRPOConfig  # noqa: E402

from grpo_jax.grpo import loss as L  # noqa: E402
from grpo_jax.grpo.batch import Batch  # noqa: E402
from grpo_jax.grpo.train_step import (StepConfig, TrainState, accumulate,  # noqa: E402
                                      finish_entropy_control, init_train_state)

T = 7
TOL = 1e-5


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


def close(name, got, want, worst):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert (np.isnan(got) == np.isnan(want)).all(), (name, got, want)  # TRL's nanmin of nothing
    got, want = got[~np.isnan(want)], want[~np.isnan(want)]
    if not want.size:
        return
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    worst[name] = max(worst.get(name, 0.0), err / scale)
    assert err <= TOL * scale, f"{name}: |grpo-jax - TRL| = {err:.3g} (scale {scale:.3g})"


IS = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=0.6,
          vllm_importance_sampling_clip_max=1.8)
KL = dict(beta=0.04)
# (LossConfig settings, options): k micro-batches; old: old_logp given (else on-policy);
# sampler: sampler log-probs given (TRL: vLLM); spg: steps_per_generation (> k: the step is a
# part of the generation batch, whose tokens are TRL's num_items_in_batch).
CASES = [
    (dict(loss_type="grpo"), {}), (dict(loss_type="bnpo"), {}), (dict(loss_type="dr_grpo"), {}),
    (dict(loss_type="dapo"), {}), (dict(loss_type="cispo", epsilon_high=1.1), {}),
    (dict(loss_type="sapo"), {}),
    (dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, **KL), {}),
    (dict(loss_type="luspo", importance_sampling_level="sequence"), {}),
    (dict(loss_type="luspo"), dict(k=1)),
    (dict(loss_type="vespo"), {}),
    (dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
          vespo_lambda_neg=5.0), dict(k=1)),
    (dict(loss_type="vespo", **IS, vllm_importance_sampling_mode="token_truncate"),
     dict(sampler=True)),
    (dict(loss_type="vespo", **IS, vllm_importance_sampling_mode="token_mask"),
     dict(sampler=True, old=False)),
    # The KL term, with and without the importance ratio, token and sequence level.
    (dict(**KL), {}), (dict(**KL, use_bias_correction_kl=False), {}),
    (dict(**KL, loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1), {}),
    (dict(**KL, loss_type="grpo", importance_sampling_level="sequence",
          use_bias_correction_kl=False), {}),
    (dict(**KL, loss_type="cispo", epsilon_high=1.1), dict(k=1)),
    (dict(**KL), dict(old=False)),  # on-policy: the ratio is 1 but has a gradient
    (dict(**KL, delta=1.15, epsilon=0.1), {}),
    (dict(epsilon_high=0.28), dict(k=1)),
    (dict(mask_truncated_completions=True, loss_type="grpo", **KL), {}),
    # The off-policy sequence mask: against the sampler's log-probs, or the old ones.
    (dict(off_policy_mask_threshold=0.02), dict(sampler=True)),
    (dict(off_policy_mask_threshold=0.02, loss_type="grpo", **KL), {}),
    (dict(off_policy_mask_threshold=0.0), dict(old=False)),
    # top_entropy_quantile: its threshold is per micro-batch, in TRL too.
    (dict(top_entropy_quantile=0.3), {}), (dict(top_entropy_quantile=0.0), dict(k=1)),
    (dict(top_entropy_quantile=0.5, mask_truncated_completions=True, loss_type="grpo"), {}),
    # The sampler importance-sampling correction, each mode.
    (dict(**IS, vllm_importance_sampling_mode="token_truncate"), dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="token_mask"), dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="sequence_truncate", loss_type="dr_grpo"),
     dict(sampler=True)),
    (dict(**IS, vllm_importance_sampling_mode="sequence_mask", **KL), dict(sampler=True)),
    (dict(vllm_importance_sampling_correction=True), dict(sampler=True, old=False)),  # TRL's
    (dict(vllm_importance_sampling_correction=False), dict(sampler=True)),  # metrics only
    # The entropy bonus: a mean per micro-batch, averaged over the k micro-batches.
    (dict(entropy_coef=0.01), {}), (dict(entropy_coef=0.05, loss_type="grpo", **KL), dict(k=4)),
    (dict(entropy_coef=0.02, top_entropy_quantile=0.4), dict(k=1)),
    (dict(entropy_coef=-0.03, loss_type="bnpo", mask_truncated_completions=True), {}),
    # num_items_in_batch over a generation batch of several steps.
    (dict(loss_type="dapo", **KL), dict(spg=6)), (dict(loss_type="cispo"), dict(spg=4)),
    (dict(loss_type="vespo"), dict(spg=8, k=4)),
    (dict(loss_type="dapo", entropy_coef=0.01), dict(spg=4, old=False)),
    # The window that ends an epoch with fewer micro-batches than gradient_accumulation_steps:
    # transformers' current_gradient_accumulation_steps is its own count (here 1 of a 3-step
    # generation batch).
    (dict(loss_type="dapo", entropy_coef=0.01), dict(spg=3, k=1)),
    (dict(loss_type="grpo", entropy_coef=0.02), dict(spg=3, k=1)),
]


def case_id(case):
    kw, opt = case
    return ",".join([f"{k}={v}" for k, v in {**kw, **opt}.items() if "clip_m" not in k
                     and k != "vllm_importance_sampling_correction"]) or "default"


WORST = {}


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_loss_and_gradients_match_trl(case):
    kw, opt = case
    cfg = L.LossConfig(**{"vllm_importance_sampling_correction": False, **kw})
    k, old, sampler, spg = opt.get("k", 2), opt.get("old", True), opt.get("sampler", False), \
        opt.get("spg", opt.get("k", 2))
    rows = 8
    x = make_inputs(len(CASES) + CASES.index(case), rows * spg // k)
    gen_mask = L.loss_mask(x["completion_mask"], x["truncated"], cfg)
    num_items = float(np.asarray(gen_mask).sum())  # TRL: the generation batch's loss tokens
    items = L.num_items_per_row(x["completion_mask"], x["truncated"], cfg) if spg != k else None
    t = trl_trainer(cfg, k, spg, use_vllm=sampler)
    want, want_glp, want_gent = run_trl(t, x, cfg, k, rows, old, sampler, num_items)
    got, glp, gent, sums = jax_step(x, cfg, k, rows, old, sampler, items)
    close("loss", got, want, WORST)
    close("grad logp", glp, want_glp, WORST)
    close("grad entropy", gent, want_gent, WORST)
    assert np.abs(want_glp).max() > 1e-3  # the gradient is there to compare
    if cfg.entropy_bonus:
        assert np.abs(want_gent).max() > 1e-4
    # TRL's buffer gets one value per micro-batch; so does step_metrics' list of each.
    metrics = L.step_metrics(sums)
    logged = {n: v for n, v in t._metrics["train"].items() if n != "entropy_coef"}
    assert logged and set(logged) <= set(metrics), set(logged) - set(metrics)
    assert ("policy_loss" in logged) == cfg.entropy_bonus
    for n, v in logged.items():
        assert len(v) == k and np.shape(metrics[n]) == (k,), n
        close(f"metric {n}", metrics[n], v, WORST)


def test_adaptive_entropy_matches_trl():
    """Three steps of 2 micro-batches with use_adaptive_entropy: TRL's coefficient (gated by the
    previous step's entropy, moved after each step) vs init_train_state / applied_entropy_coef /
    finish_entropy_control, and each step's loss and gradients."""
    cfg = L.LossConfig(vllm_importance_sampling_correction=False, use_adaptive_entropy=True,
                       entropy_coef=0.05, entropy_coef_delta=0.02, entropy_coef_min=0.02,
                       entropy_coef_max=0.08, entropy_target=1.0, top_entropy_quantile=0.6)
    k, rows = 2, 8
    t = trl_trainer(cfg, k, k, use_vllm=False)
    state = init_train_state(None, None, cfg)
    coefs, worst = [], {}
    # Entropies around 1.5 (above the target: coefficient down), then 0.5 (below: up).
    for step, scale in enumerate((3.0, 1.0, 1.0, 3.0)):
        x = make_inputs(100 + step, rows, entropy_scale=scale)
        num_items = float(np.asarray(L.loss_mask(x["completion_mask"], x["truncated"],
                                                 cfg)).sum())
        want, want_glp, want_gent = run_trl(t, x, cfg, k, rows, True, False, num_items)
        coef = L.applied_entropy_coef(state.entropy_coef, state.last_entropy, cfg)
        got, glp, gent, sums = jax_step(x, cfg, k, rows, True, False, None, coef)
        state, metrics = finish_entropy_control(state, L.step_metrics(sums), cfg)
        close("loss", got, want, worst)
        close("grad logp", glp, want_glp, worst)
        close("grad entropy", gent, want_gent, worst)
        close("entropy_coef", float(state.entropy_coef), t.entropy_coef, worst)
        close("metric entropy_coef", float(metrics["entropy_coef"]),
              t._metrics["train"]["entropy_coef"][-1], worst)
        close("last entropy", float(state.last_entropy), t._last_world_entropy, worst)
        assert L.ADAPTIVE_ENTROPY not in metrics
        coefs.append(round(t.entropy_coef, 6))
    # The coefficient moved both ways; the gate was closed in the first two steps (no entropy
    # measured yet, then entropy above the target) and open in the last two.
    assert coefs == [0.03, 0.05, 0.07, 0.05], coefs


def test_defaults_match_trl():
    """LossConfig's fields are GRPOConfig's, with its defaults; its loss types are TRL's."""
    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(L.LossConfig):
        assert f.name in trl_defaults, f.name
        assert f.default == trl_defaults[f.name], f.name
    help_text = next(f for f in dataclasses.fields(GRPOConfig)
                     if f.name == "loss_type").metadata["help"]
    for name in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        assert f"'{name}'" in help_text and name in L.LossType.__args__, name


def test_new_settings_are_validated():
    bad = [(dict(sapo_temperature_neg=0.0), "sapo_temperature"),
           (dict(vespo_lambda_pos=0.0), "vespo_lambda"), (dict(vespo_k_neg=-1.0), "vespo_k"),
           (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min"),
           (dict(entropy_coef_delta=-0.1), "entropy_coef_delta"),
           (dict(off_policy_mask_threshold=-0.5), "off_policy_mask_threshold")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            L.LossConfig(**kw)
    x = make_inputs(0, 4)
    cfg = L.LossConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="token-level"):  # TRL raises this too (with vLLM)
        jax_step(x, cfg, 1, 4, True, True, None)
