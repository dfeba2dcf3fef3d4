"""AdamW with transformers' learning-rate schedules, built from the `optim` settings."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

import jax
import optax

from grpo_jax.errors import check

# A skipped update never makes the next one apply regardless: TRL skips every non-finite one.
_NEVER = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """transformers' TrainingArguments names and defaults (the config's `optim` section)."""

    learning_rate: float = 1e-6
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine",
                               "cosine_with_min_lr"] = "linear"
    # cosine_with_min_lr's floor, as transformers: {min_lr_rate: 0.1} or {min_lr: 1e-7}.
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
        kw = self.lr_scheduler_kwargs or {}
        check(self.lr_scheduler_type == "cosine_with_min_lr" or not kw, f"lr_scheduler_kwargs "
              f"{kw} are read by lr_scheduler_type cosine_with_min_lr only")
        check(self.lr_scheduler_type != "cosine_with_min_lr" or len(kw) == 1
              and set(kw) <= {"min_lr", "min_lr_rate"}, "cosine_with_min_lr needs "
              "lr_scheduler_kwargs: {min_lr_rate: R} or {min_lr: LR}")

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
    """transformers' schedules: linear warmup, then constant, linear decay or cosine decay."""
    warm = cfg.num_warmup_steps(total_steps)
    rest = max(total_steps - warm, 1)
    lr = cfg.learning_rate
    after = {
        "constant": lambda: optax.constant_schedule(lr),
        "constant_with_warmup": lambda: optax.constant_schedule(lr),
        "linear": lambda: optax.linear_schedule(lr, 0.0, rest),
        "cosine": lambda: optax.cosine_decay_schedule(lr, rest),
        "cosine_with_min_lr": lambda: optax.cosine_decay_schedule(lr, rest,
                                                                  alpha=cfg.min_lr_rate()),
    }[cfg.lr_scheduler_type]()
    if not warm:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


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
