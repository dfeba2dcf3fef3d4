"""AdamW with transformers' learning-rate schedules, built from the `optim` settings."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

from grpo_jax.config.batch import OptimizerConfig

# A skipped update never makes the next one apply regardless: TRL skips every non-finite one.
_NEVER = 2**31 - 1


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """transformers' schedule for lr_scheduler_type: learning_rate times the lr_lambda of its
    schedule function (transformers.optimization), with num_training_steps = total_steps."""
    lr, kind, kw = cfg.learning_rate, cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs or {}
    W, T = cfg.num_warmup_steps(total_steps), total_steps
    cycles = float(kw.get("num_cycles", 1 if kind == "cosine_with_restarts" else 0.5))

    def factor(s):
        warmup = s / max(1, W)
        progress = (s - W) / max(1, T - W)
        half_cos = 0.5 * (1.0 + jnp.cos(jnp.pi * cycles * 2.0 * progress))
        if kind == "constant":
            return jnp.ones_like(s)
        if kind == "constant_with_warmup":
            return jnp.where(s < W, warmup, 1.0)
        if kind == "linear":
            return jnp.where(s < W, warmup, jnp.maximum(0.0, (T - s) / max(1, T - W)))
        if kind == "cosine":
            return jnp.where(s < W, warmup, jnp.maximum(0.0, half_cos))
        if kind == "cosine_with_min_lr":
            rate = cfg.min_lr_rate()
            return jnp.where(s < W, warmup, jnp.maximum(0.0, half_cos * (1 - rate) + rate))
        if kind == "cosine_with_restarts":
            restart = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.mod(cycles * progress, 1.0)))
            return jnp.where(s < W, warmup, jnp.where(progress >= 1.0, 0.0,
                                                      jnp.maximum(0.0, restart)))
        if kind == "polynomial":
            end, power = float(kw.get("lr_end", 1e-7)), float(kw.get("power", 1.0))
            remaining = 1.0 - (s - W) / max(T - W, 1)
            decay = ((lr - end) * jnp.maximum(remaining, 0.0) ** power + end) / lr
            return jnp.where(s < W, warmup, jnp.where(s > T, end / lr, decay))
        return _wsd_factor(s, W, T, kw)  # warmup_stable_decay

    def schedule(count):
        return lr * factor(jnp.asarray(count, jnp.float32))
    return schedule


def _wsd_factor(s, W: int, T: int, kw: dict):
    """transformers' _get_wsd_scheduler_lambda (get_wsd_schedule's stable length: given, or
    the steps left after warmup and decay)."""
    D, floor = int(kw["num_decay_steps"]), float(kw.get("min_lr_ratio", 0.0))
    S = int(kw["num_stable_steps"]) if kw.get("num_stable_steps") is not None else T - W - D
    cycles = float(kw.get("num_cycles", 0.5))

    def shape(kind, p, rising):
        if kind == "linear":
            return p if rising else 1.0 - p
        if kind == "cosine":
            return (0.5 * (1.0 - jnp.cos(jnp.pi * p)) if rising
                    else 0.5 * (1.0 + jnp.cos(jnp.pi * cycles * 2.0 * p)))
        return 1.0 - jnp.sqrt(jnp.maximum(1.0 - p, 0.0) if rising else p)  # 1-sqrt

    up = shape(kw.get("warmup_type", "linear"), s / max(1, W), True)
    down = shape(kw.get("decay_type", "cosine"), jnp.clip((s - W - S) / max(1, D), 0.0, None),
                 False)
    return jnp.where(s < W, jnp.maximum(0.0, up * (1.0 - floor) + floor),
                     jnp.where(s < W + S, 1.0,
                               jnp.where(s < W + S + D,
                                         jnp.maximum(0.0, down * (1.0 - floor) + floor),
                                         floor)))


# transformers' Trainer decays every parameter except biases and norm weights
# (`Trainer.get_decay_parameter_names`: LayerNorm modules and names matching bias, layernorm,
# rmsnorm, norm, *_norm). In the decoder's parameter table (grpo_jax.models.param_table) those
# are the *norm scales and the q/k/v biases bq, bk, bv; the embedding and lm_head decay.
_NO_DECAY = re.compile(r"bias|norm$|^b[qkv]$")


def decay_mask(params):
    """True for the leaves weight decay applies to, False for biases and norm weights (by the
    leaf's name: the last string key on its path, e.g. layers/attn_norm -> attn_norm)."""
    def decays(path, _):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)
                and isinstance(k.key, str)]
        return not (keys and _NO_DECAY.search(keys[-1].lower()))
    return jax.tree_util.tree_map_with_path(decays, params)


def frozen_labels(params, frozen: tuple[str, ...]):
    """"frozen" for the leaves under a top-level name in `frozen`, else "train"."""
    def label(path, _):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return "frozen" if keys and keys[0] in frozen else "train"
    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, frozen: tuple[str, ...] = ()):
    """(transformation, schedule). A non-finite gradient leaves params and optimizer state
    untouched (optax.apply_if_finite; its state counts the skips). Weight decay skips biases
    and norm weights (`decay_mask`), as transformers does. `frozen`: top-level parts of the
    params (a vision tower) that get no update, no decay and no optimizer moments; the
    gradient clipping's norm is over the trained leaves."""
    schedule = make_schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm else optax.identity(),
        optax.adamw(schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                    weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    if frozen:
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                   lambda params: frozen_labels(params, frozen))
    return optax.apply_if_finite(tx, _NEVER), schedule
