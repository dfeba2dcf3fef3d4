"""The GRPO objective of TRL's GRPOTrainer (TRL 1.16), as sums that make gradient accumulation
exact.

A step's policy loss is sum(numerators) / sum(denominators) over its k micro-batches; the
denominator depends on the masks only, so the summed gradients divided once equal one big batch's
gradient. Per loss_type (m = loss mask, L = per-token loss, B = sequences in the micro-batch):
  grpo, sapo  sum_i sum_t(m L) / max(sum_t m, 1)  /  B     (mean over sequences)
  luspo       sum(m L)                            /  B     (each sequence's sum, mean over them)
  bnpo        sum(m L) / max(sum(m), 1)           /  1     (normalised per micro-batch, as TRL:
                                                             k micro-batches give their mean)
  dr_grpo     sum(m L)                            /  B * max_completion_length (Batch.num_items
                                                             carries it per row: the trainer
                                                             pads to less when it can)
  dapo        sum(m L)                            /  the step's share of num_items_in_batch
  cispo, vespo  as dapo.
num_items_in_batch is TRL's normaliser: the loss tokens of the whole generation batch, and a step
divides by num_items_in_batch * gradient_accumulation_steps / steps_per_generation, i.e. the
generation batch's mean loss tokens per optimizer step. Batch.num_items carries it spread evenly
over the generation batch's rows (num_items_per_row), so a step's rows sum to exactly that; when
Batch.num_items is None the denominator is the step's own loss tokens, which is the same number
when an optimizer step is one whole generation batch (steps_per_generation ==
gradient_accumulation_steps, TRL's default) and differs otherwise.

The entropy bonus (entropy_coef) is TRL's: the loss minus coef * the mean entropy of the loss
tokens (after top_entropy_quantile's mask) of each micro-batch, averaged over the k micro-batches.
TRL takes that mean per micro-batch, so it is a second (numerator, denominator) pair with
numerator = the micro-batch's mean entropy and denominator 1 per micro-batch (like bnpo); a step
is then sum(numerators) / sum(denominators) - coef * sum(entropy means) / k (MicroLoss,
grpo_jax.grpo.train_step). With use_adaptive_entropy the coefficient is carried across steps
(adaptive_entropy_coef, update_entropy_coef: TRL's controller, fed the step's token-mean entropy).

With one micro-batch on one device each equals TRL's loss exactly; with k micro-batches too (tests
compare against TRL's own _compute_loss). What stays per micro-batch, as in TRL: bnpo's normaliser,
the entropy bonus's mean and top_entropy_quantile's threshold. One difference remains with several
data-parallel devices: TRL normalises bnpo (and the entropy bonus's mean) per device, each device
dividing its own rows' sum by its own rows' token count, and then averages the devices' losses
(DDP's gradient mean): sum_d (S_d / N_d) / D. Here a micro-batch is the global one (all devices'
rows), so bnpo gives S / N = sum_d S_d / sum_d N_d. The two agree on one device, or when every
device's rows hold the same number of loss tokens; otherwise bnpo (and the entropy bonus) weigh
tokens on short-completion devices differently from TRL. TRL's top_entropy_quantile gathers the
entropies of all devices, as here. grpo, sapo, luspo, dr_grpo, dapo, cispo and vespo are exact on
any mesh.

off_policy_mask_threshold measures the KL of the sampler's log-probs (Batch.sampler_logp; TRL:
vLLM's) against the current policy, falling back to the old log-probs when sampler_logp is None,
as TRL does without vLLM. With the JAX sampler, sampler_logp are the old policy's own log-probs up
to the sampler's numerics (tests/test_sampler.py: < 1e-4), where TRL (no vLLM) uses recomputed
ones: a sequence whose mean KL is within that of the threshold can be kept in one and dropped in
the other. The KL term's ratio (use_bias_correction_kl) is taken before delta's cap, as in TRL.
rollout_rs (verl's rollout rejection sampling; not TRL's) multiplies the per-token loss by a 0/1
mask of the sampler ratio exp(old - sampler) within its bounds (rollout_rs_mask: per token, or
per sequence by the geometric mean), after TRL's correction weight; the denominator is left as
it is, as TRL's *_mask modes leave it. With the JAX sampler, TRL's correction applies only with
native_importance_sampling_correction (policy.step_config); the sampling/* metrics are logged on
every path. Clip metrics are logged for grpo, bnpo, dr_grpo, dapo and luspo, cispo_clip_ratio
for cispo, vespo/phi_seq_mean for vespo and none for sapo, as TRL.

Metrics come back as mergeable sums: {"mean": {name: [sum, count]}, "min": {name: v},
"max": {name: v}}; combine micro-batches with merge_metric_sums, read with finalize_metrics. TRL
logs the loss metrics once per micro-batch (each its own token mean, min or max) and averages
those values over a logging window, so a step reports each micro-batch's value (step_metrics);
the PER_GENERATION metrics TRL computes once per generation batch, so their sums are merged over
a generation's micro-batches. With the entropy bonus on, "policy_loss" is each micro-batch's
policy loss as TRL's: its own normaliser for grpo, bnpo, dr_grpo, luspo and sapo, the whole
step's for dapo, cispo and vespo (with_step_denominator).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.grpo.batch import Batch
from grpo_jax.config.grpo import (LOSS_KINDS, ISLevel, ISMode, LossConfig,  # noqa: F401 (API)
                                  LossType, RSMode)
from grpo_jax.models import moe

f32 = jnp.float32


# The metric-sums entry that feeds the adaptive entropy controller (not a logged metric).
ADAPTIVE_ENTROPY = "_adaptive_entropy"


def loss_mask(completion_mask, truncated, cfg: LossConfig) -> jax.Array:
    """[B, T] fp32: completion tokens, minus truncated completions if mask_truncated_completions."""
    m = completion_mask.astype(f32)
    if cfg.mask_truncated_completions:
        m = m * (1.0 - truncated.astype(f32))[:, None]
    return m


def num_items_per_row(completion_mask, truncated, cfg: LossConfig,
                      width: int | None = None) -> np.ndarray:
    """Batch.num_items for a whole generation batch (host arrays): TRL's num_items_in_batch (its
    loss tokens) / its rows, on every row [N] fp32, so that any step's rows sum to that step's
    share of it (see the module docstring). dr_grpo's denominator instead: `width`
    (max_completion_length; default: the mask's) on every row, so that a batch whose
    completions the trainer pads to less (shapes.completion_width) still divides by it."""
    if LOSS_KINDS[cfg.loss_type].denominator == "padded":
        return np.full(len(completion_mask), width or np.shape(completion_mask)[1], np.float32)
    m = np.asarray(completion_mask, np.float64)
    if cfg.mask_truncated_completions:
        m = m * (1.0 - np.asarray(truncated, np.float64))[:, None]
    return np.full(m.shape[0], m.sum() / m.shape[0], np.float32)


def loss_denominator(completion_mask, truncated, cfg: LossConfig, num_items=None) -> jax.Array:
    """The micro-batch's share of the step's loss denominator (see the module docstring).
    num_items: the micro-batch's Batch.num_items, or None (the micro-batch's own loss tokens)."""
    m = loss_mask(completion_mask, truncated, cfg)
    kind = LOSS_KINDS[cfg.loss_type].denominator
    if kind in ("num_items", "padded") and num_items is not None:
        return jnp.asarray(num_items, f32).sum()
    if kind == "num_items":
        return m.sum()
    return jnp.asarray({"sequences": m.shape[0], "one": 1.0, "padded": m.size}[kind], f32)


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
    or zeroed outside [clip_min, clip_max] (*_mask). A constant: no gradient. A NaN sampler
    log-prob (a token the sampler could not score) counts as no difference, as in TRL."""
    diff = jnp.nan_to_num((jax.lax.stop_gradient(old_logp) - sampler_logp.astype(f32)) * m,
                          nan=0.0)
    if cfg.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    w = jnp.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    lo, hi = -jnp.inf if lo is None else lo, jnp.inf if hi is None else hi
    if cfg.vllm_importance_sampling_mode.endswith("_truncate"):
        return jnp.clip(w, lo, hi)
    return jnp.where((w < lo) | (w > hi), 0.0, w)


def rollout_rs_mask(old_logp, sampler_logp, m, cfg: LossConfig) -> jax.Array:
    """verl's rollout rejection sampling (cfg.rollout_rs): [B, T] fp32, 1 = keep, 0 = drop.
    The ratio is exp(old - sampler) (k1 = old - sampler, the log-ratio), kept iff within
    cfg.rollout_rs_bounds [lo, hi]:
      token_k1     per token: a two-sided token mask (IcePop's band, without its weight);
      seq_mean_k1  per sequence: exp(mean of k1 over its loss tokens m), the geometric mean
                   of its ratios (MIS); every token of a sequence outside the band dropped.
    A NaN sampler log-prob counts as k1 0 (ratio 1), as sampler_is_weight; a sequence without
    loss tokens has ratio 1. A constant: no gradient."""
    k1 = jnp.nan_to_num((jax.lax.stop_gradient(old_logp) - sampler_logp.astype(f32)) * m,
                        nan=0.0)
    if cfg.rollout_rs == "seq_mean_k1":
        k1 = k1.sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    elif cfg.rollout_rs != "token_k1":
        raise ValueError(f"rollout_rs must be one of {RSMode.__args__}, got {cfg.rollout_rs!r}")
    ratio = jnp.exp(k1)
    lo, hi = cfg.rollout_rs_bounds
    return jnp.broadcast_to((ratio >= lo) & (ratio <= hi), m.shape).astype(f32)


def off_policy_mask(A, logp, sampler_logp, m, threshold: float) -> jax.Array:
    """[B, 1] 1 = keep: advantage >= 0, or the sequence's mean KL estimate sampler_logp - logp
    (NaN tokens count 0) is <= threshold (DeepSeek-V3.2's off-policy sequence mask)."""
    kl = jnp.nan_to_num(sampler_logp.astype(f32) - jax.lax.stop_gradient(logp), nan=0.0)
    mean_kl = (kl * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    return ((A >= 0) | (mean_kl <= threshold)).astype(f32)


def vespo_weight(A, log_ratio, m, is_weight, cfg: LossConfig) -> jax.Array:
    """[B, 1] VESPO's Gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence's
    ratio w = exp(sum_t clip(log_ratio, -20, 20) + sum_t log(is_weight)), computed in log space
    with TRL's clamps (log w in [log 1e-8, 20]); non-finite weights become 0. No gradient."""
    sg = jax.lax.stop_gradient
    lower = math.log(1e-8)
    log_w = (jnp.clip(sg(log_ratio), -20.0, 20.0) * m).sum(-1, keepdims=True)
    if is_weight is not None:  # token-level sampler correction, summed over every position
        log_w = log_w + jnp.clip(jnp.log(is_weight), lower, 20.0).sum(-1, keepdims=True)
    log_w = jnp.clip(log_w, lower, 20.0)
    nonneg = A >= 0
    k = jnp.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = jnp.maximum(jnp.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return sg(jnp.where(jnp.isfinite(phi), phi, 0.0))


class _Terms(NamedTuple):
    """What the loss computed on the way, for its metrics (all without gradient)."""
    m: jax.Array  # [B, T] loss mask
    A: jax.Array  # [B, 1] advantages
    old: jax.Array  # [B, T] old log-probs
    ratio: jax.Array  # [B, T] or [B, 1] (sequence level)
    kl: jax.Array | None  # [B, T] when beta > 0 (times the ratio with use_bias_correction_kl)
    is_weight: jax.Array | None  # sampler importance weight when sampler_logp is given
    phi: jax.Array | None  # [B, 1] vespo's weights
    rs_keep: jax.Array | None = None  # [B, T] rollout_rs's mask (1 = keep) when it is on


class MicroLoss(NamedTuple):
    """One micro-batch's share of a step's loss (see the module docstring):
    loss = sum(numerator) / sum(loss_denominator) - coef * sum(entropy_mean) / k."""
    numerator: jax.Array  # scalar, differentiable
    entropy_mean: jax.Array | None  # scalar, differentiable; None without the entropy bonus
    sums: dict  # metric sums
    # A mixture of experts' load-balancing loss (models/moe.py), differentiable; None: off.
    aux_loss: jax.Array | None = None


def micro_loss_terms(logp, entropy, batch: Batch, cfg: LossConfig) -> MicroLoss:
    """One micro-batch's policy-loss numerator, entropy-bonus mean and metric sums.

    logp [B, T]: the policy's log-probs of batch.completion_ids (differentiated). entropy [B, T]
    or None (needed for top_entropy_quantile < 1 and for the entropy bonus, where it is
    differentiated; also logged). From the batch: old_logp None means on-policy (num_iterations
    1), i.e. stop_gradient(logp); ref_logp is needed iff beta > 0; sampler_logp is logged when
    given, applied as an importance weight when vllm_importance_sampling_correction, and used by
    off_policy_mask_threshold.
    """
    if (logp.ndim != 2 or batch.completion_mask.shape != logp.shape
            or batch.advantages.shape != logp.shape[:1]):
        raise ValueError(f"need logp and completion_mask [B, T] and advantages [B], got "
                         f"{logp.shape}, {batch.completion_mask.shape}, {batch.advantages.shape}")
    if entropy is None and (cfg.top_entropy_quantile < 1.0 or cfg.entropy_bonus):
        raise ValueError("top_entropy_quantile < 1 and the entropy bonus (entropy_coef, "
                         "use_adaptive_entropy) need the per-token entropy: pass entropy")
    logp = logp.astype(f32)
    m = loss_mask(batch.model_mask(), batch.truncated, cfg)
    A = batch.advantages.astype(f32)[:, None]
    sg = jax.lax.stop_gradient
    old = sg(logp) if batch.old_logp is None else batch.old_logp.astype(f32)
    token_log_ratio = logp - old
    log_ratio = token_log_ratio
    if cfg.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence
        log_ratio = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(
            m.sum(-1, keepdims=True), 1.0)
    ratio = jnp.exp(log_ratio)

    is_weight = None
    if batch.sampler_logp is not None:
        is_weight = sampler_is_weight(old, batch.sampler_logp, m, cfg)
    if cfg.vllm_importance_sampling_correction and is_weight is None:
        raise ValueError("vllm_importance_sampling_correction needs sampler_logp (the "
                         "sampler's per-token log-probs)")
    correction = is_weight if cfg.vllm_importance_sampling_correction else None
    rs_keep = None
    if cfg.rollout_rs is not None:
        if batch.sampler_logp is None:
            raise ValueError("rollout_rs needs sampler_logp (the sampler's per-token log-probs)")
        rs_keep = rollout_rs_mask(old, batch.sampler_logp, m, cfg)
    objective = LOSS_KINDS[cfg.loss_type].objective
    if (objective == "vespo" and correction is not None
            and cfg.vllm_importance_sampling_mode.startswith("sequence")):
        raise ValueError("vespo with vllm_importance_sampling_correction needs a token-level "
                         "vllm_importance_sampling_mode (token_truncate or token_mask), got "
                         f"{cfg.vllm_importance_sampling_mode!r}")

    kl = None
    if cfg.beta > 0:
        if batch.ref_logp is None:
            raise ValueError(f"beta={cfg.beta} needs ref_logp (the reference model's log-probs)")
        d = batch.ref_logp.astype(f32) - logp
        kl = jnp.exp(d) - d - 1.0
        if cfg.use_bias_correction_kl:
            kl = kl * ratio

    phi = None
    if objective == "cispo":  # clip the (detached) ratio, keep the log-prob's gradient
        per_token = -sg(jnp.minimum(ratio, cfg.eps_high)) * A * logp
    elif objective == "sapo":  # a soft, temperature-controlled gate instead of the clip
        tau = jnp.where(A > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token = -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * A
    elif objective == "vespo":  # a sequence weight (no gradient) on the log-prob's gradient
        phi = vespo_weight(A, token_log_ratio, m, correction, cfg)
        per_token = -phi * A * logp
    else:
        clipped = jnp.clip(ratio, 1.0 - cfg.epsilon, 1.0 + cfg.eps_high)
        if cfg.delta is not None:  # after the KL's ratio, before the metrics' (as TRL)
            ratio = jnp.minimum(ratio, cfg.delta)
        per_token = -jnp.minimum(ratio * A, clipped * A)

    if cfg.off_policy_mask_threshold is not None:
        reference = old if batch.sampler_logp is None else batch.sampler_logp
        per_token = per_token * off_policy_mask(A, logp, reference, m,
                                                cfg.off_policy_mask_threshold)
    ent_mask = None
    if cfg.top_entropy_quantile < 1.0:
        ent_mask = high_entropy_mask(entropy, m, cfg.top_entropy_quantile)
        per_token = per_token * ent_mask
    if correction is not None and objective != "vespo":  # vespo has it inside phi
        per_token = per_token * correction
    if rs_keep is not None:
        per_token = per_token * rs_keep
    if kl is not None:
        per_token = per_token + cfg.beta * kl

    masked = jnp.broadcast_to(per_token, m.shape) * m
    kind = LOSS_KINDS[cfg.loss_type].numerator
    if kind == "sequence_mean":
        numerator = (masked.sum(-1) / jnp.maximum(m.sum(-1), 1.0)).sum()
    elif kind == "token_mean":
        numerator = masked.sum() / jnp.maximum(m.sum(), 1.0)
    else:
        numerator = masked.sum()

    entropy_mean = None
    if cfg.entropy_bonus:
        eff = m if ent_mask is None else m * ent_mask
        entropy_mean = (entropy.astype(f32) * eff).sum() / jnp.maximum(eff.sum(), 1.0)
    terms = _Terms(m, A, sg(old), sg(ratio), None if kl is None else sg(kl), is_weight, phi,
                   rs_keep)
    sums = loss_metrics(terms, entropy, batch.sampler_logp, cfg)
    if cfg.entropy_bonus:
        den = loss_denominator(batch.model_mask(), batch.truncated, cfg, batch.num_items)
        sums["mean"]["policy_loss"] = jnp.stack([sg(numerator), den])
        if cfg.use_adaptive_entropy:  # the controller's input: the step's token-mean entropy
            eff = m if ent_mask is None else m * ent_mask
            sums["mean"][ADAPTIVE_ENTROPY] = jnp.stack(
                [(sg(entropy).astype(f32) * eff).sum(), eff.sum()])
    return MicroLoss(numerator, entropy_mean, sums)


def grpo_loss_terms(logp, entropy, batch: Batch, cfg: LossConfig):
    """One micro-batch's policy-loss numerator (scalar) and metric sums: micro_loss_terms
    without the entropy bonus's term (which a step adds from MicroLoss.entropy_mean)."""
    out = micro_loss_terms(logp, entropy, batch, cfg)
    return out.numerator, out.sums


def applied_entropy_coef(coef, last_entropy, cfg: LossConfig):
    """The coefficient a step applies: the carried one, gated (adaptive) by the previous step's
    entropy <= entropy_target (TRL starts with last_entropy = inf: no bonus in the first step)."""
    if not cfg.use_adaptive_entropy:
        return jnp.asarray(cfg.entropy_coef, f32)
    return jnp.where(last_entropy <= cfg.entropy_target, coef, 0.0).astype(f32)


def update_entropy_coef(coef, step_entropy, cfg: LossConfig):
    """TRL's adaptive controller after a step whose token-mean entropy was step_entropy: up by
    entropy_coef_delta (at most entropy_coef_max) when step_entropy <= entropy_target, else
    down (at least entropy_coef_min)."""
    up = jnp.minimum(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
    down = jnp.maximum(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
    return jnp.where(step_entropy <= cfg.entropy_target, up, down).astype(f32)


# TRL computes these in _generate_and_score_completions, once per generation batch over all its
# tokens (0 where none is valid), not per micro-batch: see per_generation_metrics. The
# rollout_corr/* ones (rollout_rs on) are verl's names, over the generation batch as verl's.
RS_METRICS = ("rollout_corr/rollout_rs_masked_fraction",
              "rollout_corr/rollout_rs_seq_masked_fraction")
PER_GENERATION = ("sampling/sampling_logp_difference/mean",
                  "sampling/sampling_logp_difference/max",
                  "sampling/importance_sampling_ratio/min",
                  "sampling/importance_sampling_ratio/mean",
                  "sampling/importance_sampling_ratio/max") + RS_METRICS + (
                      moe.ROUTER_MISMATCH,)
# step_metrics' entry holding the PER_GENERATION metrics' per-micro-batch sums (not logged as is).
GENERATION_SUMS = "_generation_sums"


def loss_metrics(t: _Terms, entropy, sampler_logp, cfg: LossConfig) -> dict:
    """TRL's loss metrics as mergeable sums (see the module docstring)."""
    means, mins, maxs = {}, {}, {}
    m, A, ratio = t.m, t.A, t.ratio
    tokens = m.sum()
    if t.kl is not None:
        kl = jnp.broadcast_to(t.kl, m.shape)
        means["kl"] = jnp.stack([(kl * m).sum(), tokens])
    if entropy is not None:
        means["entropy"] = jnp.stack([(jax.lax.stop_gradient(entropy).astype(f32) * m).sum(),
                                      tokens])
    seq_level = cfg.importance_sampling_level == "sequence"
    # A per-sequence ratio counts each sequence once; a per-token ratio each masked token.
    w_mean, count = (jnp.ones_like(m[:, :1]), jnp.asarray(m.shape[0], f32)) if seq_level else (
        m, tokens)
    objective = LOSS_KINDS[cfg.loss_type].objective
    if objective == "cispo":
        means["cispo_clip_ratio"] = jnp.stack([(((ratio > cfg.eps_high) & (A > 0)) * w_mean).sum(),
                                               count])
    elif objective == "vespo":  # one weight per sequence, each sequence counted once
        means["vespo/phi_seq_mean"] = jnp.stack([t.phi.sum(), jnp.asarray(m.shape[0], f32)])
    elif objective == "clip":
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
    out = {"mean": means, "min": mins, "max": maxs}
    if t.is_weight is not None:
        sampling = sampling_metric_sums(t.old, sampler_logp, t.is_weight, m, t.rs_keep)
        for kind in out:
            out[kind].update(sampling[kind])
    return out


def sampling_metric_sums(old, sampler_logp, is_weight, m, rs_keep=None) -> dict:
    """The PER_GENERATION metrics' sums over rows of old and sampler log-probs: |old - sampler|
    over the loss tokens the sampler scored, and the importance weight (per token or per
    sequence), as TRL's lines; with rollout_rs's mask `rs_keep`, verl's rejection fractions:
    of the loss tokens dropped, and of the sequences with loss tokens those with any dropped
    (every one of theirs, with seq_mean_k1)."""
    w = is_weight
    rs = {} if rs_keep is None else rs_metric_sums(rs_keep, m)
    diff = jnp.abs(old - sampler_logp.astype(f32))
    valid = (m > 0) & ~jnp.isnan(diff)  # as TRL: unscorable tokens left out
    name = "sampling/importance_sampling_ratio/"
    w_valid = jnp.ones(w.shape, bool) if w.shape[1] == 1 else m > 0
    return {"mean": {"sampling/sampling_logp_difference/mean": jnp.stack(
                [jnp.where(valid, diff, 0.0).sum(), valid.sum().astype(f32)]),
                     name + "mean": jnp.stack([jnp.where(w_valid, w, 0.0).sum(),
                                               w_valid.sum().astype(f32)]), **rs},
            "min": {name + "min": jnp.where(w_valid, w, jnp.inf).min()},
            "max": {"sampling/sampling_logp_difference/max": jnp.where(valid, diff,
                                                                       -jnp.inf).max(),
                    name + "max": jnp.where(w_valid, w, -jnp.inf).max()}}


def rs_metric_sums(rs_keep, m) -> dict:
    """RS_METRICS' [sum, count] pairs (see sampling_metric_sums)."""
    dropped = (1.0 - rs_keep) * m
    has = m.sum(-1) > 0
    return {RS_METRICS[0]: jnp.stack([dropped.sum(), m.sum()]),
            RS_METRICS[1]: jnp.stack([((dropped.sum(-1) > 0) & has).sum().astype(f32),
                                      has.sum().astype(f32)])}


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
    """Metric sums (one dict, merged, or a list of per-micro-batch dicts; or [k]-stacked sums,
    read per micro-batch) -> {TRL name: value}. A mean over nothing reads 0 (TRL clamps the
    count to 1); an extreme over nothing NaN (TRL's nanmin / nanmax of no value), but 0 for the
    PER_GENERATION ones (TRL logs 0 when no token is valid). Works inside jit."""
    if isinstance(sums, (list, tuple)):
        sums = functools.reduce(merge_metric_sums, sums)
    out = {k: v[..., 0] / jnp.maximum(v[..., 1], 1.0) for k, v in sums["mean"].items()}
    for k, v in {**sums["min"], **sums["max"]}.items():
        out[k] = jnp.where(jnp.isfinite(v), v, 0.0 if k in PER_GENERATION else jnp.nan)
    return out


def with_step_denominator(sums: dict, denom, cfg: LossConfig) -> dict:
    """One micro-batch's sums with its "policy_loss" normalised as TRL logs it: dapo, cispo and
    vespo divide each micro-batch's sum by the whole step's normaliser (num_items_in_batch's
    share), the other loss types by the micro-batch's own."""
    if ("policy_loss" not in sums["mean"]
            or LOSS_KINDS[cfg.loss_type].denominator != "num_items"):
        return sums
    pl = sums["mean"]["policy_loss"]
    return {**sums, "mean": {**sums["mean"], "policy_loss": jnp.stack([pl[0], denom])}}


def step_metrics(stacked) -> dict:
    """A step's metrics from its micro-batches' [k]-stacked sums: each loss metric as [k]
    values, one per micro-batch (TRL appends one per micro-batch); the adaptive entropy
    controller's input over the whole step; and, under GENERATION_SUMS, the PER_GENERATION
    metrics' sums as they are, to be merged per generation batch (per_generation_metrics)."""
    per_gen = {kind: {k: v for k, v in group.items() if k in PER_GENERATION}
               for kind, group in stacked.items()}
    kept = {kind: {k: v for k, v in group.items() if k not in PER_GENERATION
                   and k != ADAPTIVE_ENTROPY} for kind, group in stacked.items()}
    out = finalize_metrics(kept)
    if ADAPTIVE_ENTROPY in stacked["mean"]:
        total = stacked["mean"][ADAPTIVE_ENTROPY].sum(0)
        out[ADAPTIVE_ENTROPY] = total[0] / jnp.maximum(total[1], 1.0)
    if any(per_gen.values()):
        out[GENERATION_SUMS] = per_gen
    return out


def per_generation_metrics(sums, block: int) -> dict[str, list[float]]:
    """PER_GENERATION metrics from [k]-stacked sums (host arrays) of micro-batches in which
    each run of `block` consecutive ones is one generation batch: one value per generation,
    over all its tokens, as TRL computes them (0 over no valid token)."""
    out: dict[str, list[float]] = {}
    for kind, group in sums.items():
        for k, v in group.items():
            v = np.asarray(v, np.float64)
            if kind == "mean":
                t = v.reshape(-1, block, 2).sum(1)
                value = np.where(t[:, 1] > 0, t[:, 0] / np.maximum(t[:, 1], 1.0), 0.0)
            else:
                v = v.reshape(-1, block)
                value = v.min(1) if kind == "min" else v.max(1)
                value = np.where(np.isfinite(value), value, 0.0)
            out[k] = value.tolist()
    return out
