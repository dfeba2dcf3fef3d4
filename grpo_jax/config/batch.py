"""How a run is batched and optimised: TRL's batch relations (BatchArgs, resolved into a
BatchPlan) and transformers' optimizer and schedule settings."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from grpo_jax.config.fields import arg
from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class BatchArgs:
    per_device_train_batch_size: int = arg(
        8,
        "Completions per micro-step per data-parallel shard.")
    gradient_accumulation_steps: int = arg(
        1,
        "Micro-steps whose gradients make one optimizer update.")
    generation_batch_size: int | None = arg(
        None,
        "Completions per generation round (set this or steps_per_generation, not both).")
    steps_per_generation: int | None = arg(
        None,
        "Micro-steps per generation round (set this or generation_batch_size, not both; null: "
        "gradient_accumulation_steps).")
    max_steps: int = arg(-1, "> 0 overrides num_train_epochs")
    num_train_epochs: float = arg(
        3.0,
        "Passes over the prompts (a fraction allowed); max_steps > 0 overrides it.")
    pad_to_multiple_of: int | Literal["auto"] | None = arg(
        None,
        "TRL's: the trainer's batch pads completions to its longest completion rounded up to a "
        "multiple of this (at most max_completion_length). null (or TRL's 'auto'): rounded up "
        "to the length buckets of the prompts (grpo_jax.shapes), so a run compiles a handful "
        "of update programs; max_completion_length: one program, every row padded to it.")

    def __post_init__(self):
        if self.pad_to_multiple_of == "auto":  # TRL's default: here the length buckets
            object.__setattr__(self, "pad_to_multiple_of", None)
        check(self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
              f"pad_to_multiple_of must be >= 1 or null, got {self.pad_to_multiple_of}")
        check(self.per_device_train_batch_size >= 1 and self.gradient_accumulation_steps >= 1,
              "per_device_train_batch_size and gradient_accumulation_steps must be >= 1")
        check(self.generation_batch_size is None or self.steps_per_generation is None,
              "generation_batch_size and steps_per_generation can't both be set: set one "
              "(generation_batch_size = per_device_train_batch_size * data-parallel size * "
              "steps_per_generation)")
        check((self.generation_batch_size or 1) >= 1 and (self.steps_per_generation or 1) >= 1,
              "generation_batch_size and steps_per_generation must be >= 1 when set")
        check(self.max_steps == -1 or self.max_steps >= 1,
              f"max_steps must be -1 (use num_train_epochs) or >= 1, got {self.max_steps}")
        check(self.num_train_epochs > 0,
              f"num_train_epochs must be > 0, got {self.num_train_epochs}")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one generation round splits into micro-steps, resolved for a data-parallel size."""
    data_parallel_size: int
    micro_batch_size: int  # completions per micro-step over all shards
    gradient_accumulation_steps: int
    steps_per_generation: int
    generation_batch_size: int
    num_generations: int
    num_iterations: int
    pad_to_multiple_of: int | None  # BatchArgs'

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def needs_old_logps(self) -> bool:
        """TRL's rule: a generation batch is trained on by more than one optimizer update (or
        not from the start of one) unless gradient_accumulation_steps is a multiple of the
        micro-steps it feeds (steps_per_generation * num_iterations); only then can params
        change between generating and training, and the old log-probs differ."""
        return self.gradient_accumulation_steps % (self.steps_per_generation
                                                    * self.num_iterations) != 0

    def micro_steps_per_epoch(self, num_prompts: int) -> int:
        """transformers' steps_in_epoch: micro-steps (batches of TRL's dataloader) per epoch;
        an epoch's tail too short for a generation batch is skipped."""
        rounds = num_prompts // self.prompts_per_generation
        return rounds * self.steps_per_generation * self.num_iterations

    def updates_per_epoch(self, num_prompts: int) -> int:
        """transformers' num_update_steps_per_epoch: an epoch's micro-steps in windows of
        gradient_accumulation_steps, the last one partial when they do not divide."""
        return max(-(-self.micro_steps_per_epoch(num_prompts)
                     // self.gradient_accumulation_steps), 1)

    def num_train_epochs(self, num_prompts: int, total_steps: int) -> int:
        """transformers' state.num_train_epochs: the epochs the run's steps touch."""
        return -(-total_steps // self.updates_per_epoch(num_prompts))

    def epoch(self, step: int, num_prompts: int) -> float:
        """The fractional epoch transformers logs after optimizer step `step`: whole epochs
        plus micro-steps done / micro-steps of the epoch (an epoch ends with its own window,
        partial when its micro-steps are not a multiple of gradient_accumulation_steps)."""
        micro = max(self.micro_steps_per_epoch(num_prompts), 1)
        done, rest = divmod(step, self.updates_per_epoch(num_prompts))
        return done + min(rest * self.gradient_accumulation_steps, micro) / micro


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

    learning_rate: float = arg(1e-6, "The AdamW learning rate (the schedule's peak).")
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine",
                               "cosine_with_restarts", "cosine_with_min_lr", "polynomial",
                               "warmup_stable_decay"] = arg(
        "linear",
        "The learning-rate schedule, as transformers' (lr_scheduler_kwargs: its arguments).")
    lr_scheduler_kwargs: dict | None = arg(
        None,
        "The schedule's own arguments, as transformers (SCHEDULE_KWARGS): e.g. "
        "cosine_with_min_lr's {min_lr_rate: 0.1}, polynomial's {lr_end: 1e-7, power: 1.0}, "
        "warmup_stable_decay's {num_decay_steps: 100}, cosine_with_restarts' {num_cycles: 2}.")
    warmup_steps: float = arg(
        0.0,
        "Optimizer steps of linear warmup; a value < 1 is a fraction of the run's steps "
        "(transformers 5; TRL's old warmup_ratio).")
    weight_decay: float = arg(0.0, "AdamW's decoupled weight decay.")
    adam_beta1: float = arg(0.9, "AdamW's first-moment decay.")
    adam_beta2: float = arg(0.999, "AdamW's second-moment decay.")
    adam_epsilon: float = arg(1e-8, "AdamW's epsilon.")
    max_grad_norm: float = arg(1.0, "Clip the gradient to this global norm (0: no clipping).")

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
