"""AdamW with transformers' learning-rate schedules, built from the `optim` settings."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from grpo_jax.errors import check

# A skipped update never makes the next one apply regardless: TRL skips every non-finite one.
_NEVER = 2**31 - 1

# The lr_scheduler_kwargs each schedule reads (transformers' schedule functions' arguments).
SCHEDULE_KWARGS = {
    "constant": (), "constant_with_warmup": (), "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "polynomial": ("lr_end", "power"),
    "warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type",
                            "min_lr_ratio", "num_cycles"),
}
_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """transformers' TrainingArguments names and defaults (the config's `optim` section)."""

    learning_rate: float = 1e-6
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine",
                               "cosine_with_restarts", "cosine_with_min_lr", "polynomial",
                               "warmup_stable_decay"] = "linear"
    # The schedule's own arguments, as transformers (SCHEDULE_KWARGS): e.g. cosine_with_min_lr's
    # {min_lr_rate: 0.1}, polynomial's {lr_end: 1e-7, power: 1.0}, warmup_stable_decay's
    # {num_decay_steps: 100}, cosine_with_restarts' {num_cycles: 2}.
    lr_scheduler_kwargs: dict | None = None
    # transformers 5: a value < 1 is a fraction of the total steps (TRL's old warmup_ratio).
    warmup_steps: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        check(self.learning_rate >= 0, f"learning_rate must be >= 0, got {self.learning_rate}")
        w = self.warmup_steps
        check(w >= 0 and (w < 1 or float(w).is_integer()),
              f"warmup_steps must be a whole number of steps or a fraction in [0, 1), got {w}")
        check(not (self.lr_scheduler_type == "constant" and w > 0),
              "lr_scheduler_type 'constant' has no warmup: use 'constant_with_warmup'")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
              f"adam_beta1/adam_beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        check(self.weight_decay >= 0 and self.adam_epsilon > 0 and self.max_grad_norm >= 0,
              "weight_decay and max_grad_norm must be >= 0 and adam_epsilon > 0")
        kw, kind = self.lr_scheduler_kwargs or {}, self.lr_scheduler_type
        known = SCHEDULE_KWARGS[kind]
        check(set(kw) <= set(known), f"lr_scheduler_kwargs {sorted(set(kw) - set(known))}: "
              f"lr_scheduler_type {kind} reads {', '.join(known) or 'none'}")
        check(kind != "cosine_with_min_lr" or len({"min_lr", "min_lr_rate"} & set(kw)) == 1,
              "cosine_with_min_lr needs lr_scheduler_kwargs: {min_lr_rate: R} or {min_lr: LR}")
        check(kind != "warmup_stable_decay" or "num_decay_steps" in kw, "warmup_stable_decay "
              "needs lr_scheduler_kwargs: {num_decay_steps: N} (and optionally "
              "num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles)")
        for name in ("warmup_type", "decay_type"):
            check(kw.get(name, "linear") in _WSD_SHAPES,
                  f"{name} must be one of {_WSD_SHAPES}, got {kw.get(name)!r}")
        check(kind != "polynomial" or self.learning_rate > kw.get("lr_end", 1e-7),
              f"polynomial: lr_end ({kw.get('lr_end', 1e-7)}) must be smaller than "
              f"learning_rate ({self.learning_rate})")

    def min_lr_rate(self) -> float:
        """cosine_with_min_lr's floor as a fraction of learning_rate."""
        kw = self.lr_scheduler_kwargs or {}
        if "min_lr" in kw:
            return float(kw["min_lr"]) / self.learning_rate if self.learning_rate else 0.0
        return float(kw.get("min_lr_rate", 0.0))

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warmup length in optimizer steps (transformers 5's rule)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(total_steps * self.warmup_steps)


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


def make_optimizer(cfg: OptimizerConfig, total_steps: int):
    """(transformation, schedule). A non-finite gradient leaves params and optimizer state
    untouched (optax.apply_if_finite; its state counts the skips). Weight decay skips biases
    and norm weights (`decay_mask`), as transformers does."""
    schedule = make_schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm else optax.identity(),
        optax.adamw(schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                    weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    return optax.apply_if_finite(tx, _NEVER), schedule
