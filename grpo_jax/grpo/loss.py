"""The GRPO objective of TRL's GRPOTrainer, as sums that make gradient accumulation exact.

A step's loss is sum(numerators) / sum(denominators) over its micro-batches; the denominator
depends on the masks only, so the summed gradients divided once equal one big batch's gradient.
Per loss_type (m = loss mask, L = per-token loss, B = sequences in the micro-batch):
  grpo     sum_i sum_t(m L) / max(sum_t m, 1)  /  B          (mean over sequences)
  bnpo     sum(m L) / max(sum(m), 1)           /  1          (normalised per micro-batch, as TRL:
                                                              k micro-batches give their mean)
  dr_grpo  sum(m L)                            /  B * max_completion_length (the completions'
                                                              padded width: both rollout
                                                              back-ends pad to it)
  dapo     sum(m L)                            /  sum(m)     (active tokens of the whole step)
  cispo    as dapo.
With one micro-batch each equals TRL's loss. Two things stay per micro-batch like in TRL: bnpo's
normaliser and top_entropy_quantile's threshold.

Metrics come back as mergeable sums: {"mean": {name: [sum, count]}, "min": {name: v},
"max": {name: v}}; combine micro-batches with merge_metric_sums, read with finalize_metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.errors import check
from grpo_jax.grpo.batch import Batch

f32 = jnp.float32
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The objective's settings, with TRL GRPOConfig's names and defaults."""

    beta: float = 0.0  # KL coefficient; 0 needs no reference model
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon. For cispo: the cap on the ratio itself
    delta: float | None = None  # upper bound on the unclipped ratio (INTELLECT-2); None: off
    loss_type: LossType = "dapo"
    importance_sampling_level: ISLevel = "token"
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    # Sampler/trainer mismatch: weight tokens by exp(old_logp - sampler_logp). The trainer
    # applies it to vLLM rollouts only: the JAX sampler runs the trainer's own weights.
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: ISMode = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        for name, choices in (("loss_type", LossType), ("importance_sampling_level", ISLevel),
                              ("vllm_importance_sampling_mode", ISMode)):
            value, choices = getattr(self, name), typing.get_args(choices)
            check(value in choices, f"{name} must be one of {choices}, got {value!r}")
        check(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        check(self.epsilon > 0, f"epsilon must be > 0, got {self.epsilon}")
        check(self.epsilon_high is None or self.epsilon_high > 0,
              f"epsilon_high must be > 0 or null, got {self.epsilon_high}")
        check(self.delta is None or self.delta > 1, f"delta caps the ratio from above and must "
              f"be > 1 (TRL recommends > 1 + epsilon) or null, got {self.delta}")
        check(0.0 <= self.top_entropy_quantile <= 1.0,
              f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        check(lo is None or hi is None or lo < hi, f"vllm_importance_sampling_clip_min ({lo}) "
              f"must be < vllm_importance_sampling_clip_max ({hi})")
        check(not (self.vllm_importance_sampling_correction and lo is None and hi is None
                   and self.vllm_importance_sampling_mode.endswith("_truncate")),
              "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min"
              " or vllm_importance_sampling_clip_max")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def loss_mask(completion_mask, truncated, cfg: LossConfig) -> jax.Array:
    """[B, T] fp32: completion tokens, minus truncated completions if mask_truncated_completions."""
    m = completion_mask.astype(f32)
    if cfg.mask_truncated_completions:
        m = m * (1.0 - truncated.astype(f32))[:, None]
    return m


def loss_denominator(completion_mask, truncated, cfg: LossConfig) -> jax.Array:
    """The micro-batch's share of the step's loss denominator (see the module docstring)."""
    m = loss_mask(completion_mask, truncated, cfg)
    B = m.shape[0]
    return {"grpo": lambda: jnp.asarray(B, f32), "bnpo": lambda: jnp.asarray(1.0, f32),
            "dr_grpo": lambda: jnp.asarray(B * m.shape[1], f32),
            "dapo": m.sum, "cispo": m.sum}[cfg.loss_type]()


def high_entropy_mask(entropy, m, quantile: float) -> jax.Array:
    """Tokens whose entropy is >= the (1 - quantile) quantile (linear interpolation, as
    torch.quantile) of the entropies of the masked tokens. No gradient flows through it."""
    ent = jax.lax.stop_gradient(entropy).astype(f32)
    flat = jnp.sort(jnp.where(m > 0, ent, jnp.inf).reshape(-1))  # valid entries first
    n = jnp.maximum(m.sum(), 1.0)
    pos = (1.0 - quantile) * (n - 1.0)
    lo = jnp.floor(pos)
    a = flat[lo.astype(jnp.int32)]
    b = flat[jnp.minimum(lo + 1.0, n - 1.0).astype(jnp.int32)]
    threshold = a + (pos - lo) * (b - a)
    return ((ent >= threshold) & (m > 0)).astype(f32)


def sampler_is_weight(old_logp, sampler_logp, m, cfg: LossConfig) -> jax.Array:
    """exp(old - sampler) per token [B, T] or summed per sequence [B, 1], then clipped (*_truncate)
    or zeroed outside [clip_min, clip_max] (*_mask). A constant: no gradient."""
    diff = (jax.lax.stop_gradient(old_logp) - sampler_logp.astype(f32)) * m
    if cfg.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    w = jnp.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    lo, hi = -jnp.inf if lo is None else lo, jnp.inf if hi is None else hi
    if cfg.vllm_importance_sampling_mode.endswith("_truncate"):
        return jnp.clip(w, lo, hi)
    return jnp.where((w < lo) | (w > hi), 0.0, w)


class _Terms(NamedTuple):
    """What the loss computed on the way, for its metrics (all without gradient)."""
    m: jax.Array  # [B, T] loss mask
    A: jax.Array  # [B, 1] advantages
    old: jax.Array  # [B, T] old log-probs
    ratio: jax.Array  # [B, T] or [B, 1] (sequence level)
    kl: jax.Array | None  # [B, T] when beta > 0
    is_weight: jax.Array | None  # sampler importance weight when sampler_logp is given


def grpo_loss_terms(logp, entropy, batch: Batch, cfg: LossConfig):
    """One micro-batch's loss numerator (scalar) and metric sums.

    logp [B, T]: the policy's log-probs of batch.completion_ids (differentiated). entropy [B, T]
    or None (needed for top_entropy_quantile < 1; also logged). From the batch: old_logp None
    means on-policy (num_iterations 1), i.e. stop_gradient(logp); ref_logp is needed iff
    beta > 0; sampler_logp is logged when given and applied as an importance weight when
    vllm_importance_sampling_correction.
    """
    if (logp.ndim != 2 or batch.completion_mask.shape != logp.shape
            or batch.advantages.shape != logp.shape[:1]):
        raise ValueError(f"need logp and completion_mask [B, T] and advantages [B], got "
                         f"{logp.shape}, {batch.completion_mask.shape}, {batch.advantages.shape}")
    logp = logp.astype(f32)
    m = loss_mask(batch.completion_mask, batch.truncated, cfg)
    A = batch.advantages.astype(f32)[:, None]
    sg = jax.lax.stop_gradient
    old = sg(logp) if batch.old_logp is None else batch.old_logp.astype(f32)
    log_ratio = logp - old
    if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence
        log_ratio = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(
            m.sum(-1, keepdims=True), 1.0)
    ratio = jnp.exp(log_ratio)

    if cfg.loss_type == "cispo":  # clip the (detached) ratio, keep the log-prob's gradient
        per_token = -sg(jnp.minimum(ratio, cfg.eps_high)) * A * logp
    else:
        clipped = jnp.clip(ratio, 1.0 - cfg.epsilon, 1.0 + cfg.eps_high)
        if cfg.delta is not None:
            ratio = jnp.minimum(ratio, cfg.delta)
        per_token = -jnp.minimum(ratio * A, clipped * A)

    if cfg.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy: pass entropy")
        per_token = per_token * high_entropy_mask(entropy, m, cfg.top_entropy_quantile)
    is_weight = None
    if batch.sampler_logp is not None:
        is_weight = sampler_is_weight(old, batch.sampler_logp, m, cfg)
    if cfg.vllm_importance_sampling_correction:
        if is_weight is None:
            raise ValueError("vllm_importance_sampling_correction needs sampler_logp (the "
                             "sampler's per-token log-probs)")
        per_token = per_token * is_weight
    kl = None
    if cfg.beta > 0:
        if batch.ref_logp is None:
            raise ValueError(f"beta={cfg.beta} needs ref_logp (the reference model's log-probs)")
        d = batch.ref_logp.astype(f32) - logp
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + cfg.beta * kl

    masked = jnp.broadcast_to(per_token, m.shape) * m
    if cfg.loss_type == "grpo":
        numerator = (masked.sum(-1) / jnp.maximum(m.sum(-1), 1.0)).sum()
    elif cfg.loss_type == "bnpo":
        numerator = masked.sum() / jnp.maximum(m.sum(), 1.0)
    else:
        numerator = masked.sum()
    terms = _Terms(m, A, sg(old), sg(ratio), None if kl is None else sg(kl), is_weight)
    return numerator, loss_metrics(terms, entropy, batch.sampler_logp, cfg)


def loss_metrics(t: _Terms, entropy, sampler_logp, cfg: LossConfig) -> dict:
    """TRL's loss metrics as mergeable sums (see the module docstring)."""
    means, mins, maxs = {}, {}, {}
    m, A, ratio = t.m, t.A, t.ratio
    tokens = m.sum()
    if t.kl is not None:
        means["kl"] = jnp.stack([(t.kl * m).sum(), tokens])
    if entropy is not None:
        means["entropy"] = jnp.stack([(jax.lax.stop_gradient(entropy).astype(f32) * m).sum(),
                                      tokens])
    seq_level = cfg.importance_sampling_level == "sequence"
    # A per-sequence ratio counts each sequence once; a per-token ratio each masked token.
    w_mean, count = (jnp.ones_like(m[:, :1]), jnp.asarray(m.shape[0], f32)) if seq_level else (
        m, tokens)
    if cfg.loss_type == "cispo":
        means["cispo_clip_ratio"] = jnp.stack([(((ratio > cfg.eps_high) & (A > 0)) * w_mean).sum(),
                                               count])
    else:
        low = ((ratio < 1.0 - cfg.epsilon) & (A < 0)).astype(f32)
        high = ((ratio > 1.0 + cfg.eps_high) & (A > 0)).astype(f32)
        for name, x in (("low", low), ("high", high), ("region", jnp.maximum(low, high))):
            means[f"clip_ratio/{name}_mean"] = jnp.stack([(x * w_mean).sum(), count])
        # Extremes over sequences of each sequence's clipped fraction (empty sequences skipped).
        if seq_level:
            low_seq, high_seq, has = low[:, 0], high[:, 0], jnp.ones(m.shape[0], bool)
        else:
            n_seq = m.sum(-1)
            has = n_seq > 0
            low_seq = (low * m).sum(-1) / jnp.maximum(n_seq, 1.0)
            high_seq = (high * m).sum(-1) / jnp.maximum(n_seq, 1.0)
        mins["clip_ratio/low_min"] = jnp.where(has, low_seq, jnp.inf).min()
        maxs["clip_ratio/high_max"] = jnp.where(has, high_seq, -jnp.inf).max()
    if t.is_weight is not None:
        w = t.is_weight
        diff = jnp.abs(t.old - sampler_logp.astype(f32))
        means["sampling/sampling_logp_difference/mean"] = jnp.stack([(diff * m).sum(), tokens])
        maxs["sampling/sampling_logp_difference/max"] = jnp.where(m > 0, diff, -jnp.inf).max()
        w_valid = jnp.ones(w.shape, bool) if w.shape[1] == 1 else m > 0
        name = "sampling/importance_sampling_ratio/"
        means[name + "mean"] = jnp.stack([jnp.where(w_valid, w, 0.0).sum(),
                                          w_valid.sum().astype(f32)])
        mins[name + "min"] = jnp.where(w_valid, w, jnp.inf).min()
        maxs[name + "max"] = jnp.where(w_valid, w, -jnp.inf).max()
    return {"mean": means, "min": mins, "max": maxs}


def empty_metric_sums(like):
    """The identity of merge_metric_sums for sums shaped like `like` (arrays or eval_shape)."""
    full = lambda v: lambda x: jnp.full(x.shape, v, x.dtype)  # noqa: E731
    return {"mean": jax.tree.map(full(0.0), like["mean"]),
            "min": jax.tree.map(full(jnp.inf), like["min"]),
            "max": jax.tree.map(full(-jnp.inf), like["max"])}


def merge_metric_sums(a, b):
    """Combine two micro-batches' metric sums: means add, extremes take min / max."""
    return {"mean": jax.tree.map(jnp.add, a["mean"], b["mean"]),
            "min": jax.tree.map(jnp.minimum, a["min"], b["min"]),
            "max": jax.tree.map(jnp.maximum, a["max"], b["max"])}


def finalize_metrics(sums) -> dict:
    """Metric sums (one dict, merged, or a list of per-micro-batch dicts) -> {TRL name: scalar}.
    A mean over nothing reads 0, and so does an extreme over nothing. Works inside jit."""
    if isinstance(sums, (list, tuple)):
        sums = functools.reduce(merge_metric_sums, sums)
    out = {k: v[0] / jnp.maximum(v[1], 1.0) for k, v in sums["mean"].items()}
    for k, v in {**sums["min"], **sums["max"]}.items():
        out[k] = jnp.where(jnp.isfinite(v), v, 0.0)
    return out
