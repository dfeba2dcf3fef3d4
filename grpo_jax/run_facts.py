"""Facts of a run that follow from its settings alone, defined once for train, aot and bench.

Each is a short pure function of the config (and, where the run knows more, what it knows:
the dataset's size, the rollout's weight mode, the parameter count on a device). train builds
the run from them; aot lowers and sizes the same run from them without loading anything;
bench sets up its workload with them. A rule that changes here changes for all three, so a
forecast can't drift from the run it forecasts. No jax at import (config loads none either).
"""

from __future__ import annotations

import dataclasses
import math

from grpo_jax.config import BatchArgs, BatchPlan, TrainConfig

# The optimizer steps a run is taken to have where the dataset isn't loaded (aot, bench) and
# max_steps doesn't say: only the learning-rate schedule's length depends on it (a constant in
# the update program), never a shape or a memory figure.
UNLOADED_TOTAL_STEPS = 1000


# ------------------------------------------------------------------ the reference model

def has_reference(cfg: TrainConfig) -> bool:
    """Whether the run has a reference model: TRL keeps one iff beta != 0 (beta 0: no KL term,
    so no reference log-probs are computed and none is held)."""
    return cfg.loss.beta != 0.0


def keeps_reference_copy(cfg: TrainConfig) -> bool:
    """Whether the reference is a copy of the initial params (in the compute dtype) that a device
    holds beside the state: with a reference and without LoRA. LoRA's reference is the base with
    the adapters off (run_state.ADAPTERS_OFF): nothing is copied."""
    return has_reference(cfg) and not cfg.peft.use_peft


# ------------------------------------------------------------------ shapes of a round

def prompt_group(shared_prefix: bool, group_rows: int, micro_rows: int) -> int:
    """Rows per shared prompt in a micro-batch of `micro_rows` rows (completion_logps'
    `group`) when its prompts come in aligned blocks of `group_rows` consecutive rows: the
    largest block size that divides both, gcd(group_rows, micro_rows), so each block of that
    many rows holds one prompt; 1 with numerics.shared_prefix off (every row its own prompt)."""
    return math.gcd(group_rows, micro_rows) if shared_prefix else 1


def planned_prompt_group(cfg: TrainConfig, plan: BatchPlan) -> int:
    """prompt_group of the run's update and log-prob micro-batches as the config lays them out:
    a round's rows are each prompt's num_generations completions in a row, cut into
    micro_batch_size micro-batches (what Policy.prompt_group then reads in the batches)."""
    return prompt_group(cfg.numerics.shared_prefix, plan.num_generations, plan.micro_batch_size)


def total_steps(batch: BatchArgs, plan: BatchPlan, num_prompts: int | None = None) -> int:
    """The run's optimizer steps (the learning-rate schedule's length, the run's end). TRL's
    rule: max_steps when > 0, else num_train_epochs passes over the prompts in windows of
    gradient_accumulation_steps (at least 1). Where the dataset isn't loaded (num_prompts None:
    aot, bench) and max_steps doesn't say, UNLOADED_TOTAL_STEPS."""
    if batch.max_steps > 0:
        return batch.max_steps
    if num_prompts is None:
        return UNLOADED_TOTAL_STEPS
    return max(1, math.ceil(batch.num_train_epochs * plan.updates_per_epoch(num_prompts)))


# ------------------------------------------------------------------ the sampler's weights

PARAMS, MERGED, ADAPTERS_AND_BASE = "params", "merged", "adapters_and_base"


def sampler_weights(mode, has_lora: bool) -> str:
    """The form of the trainer's weights a rollout reads or is pushed, for its
    rollout.base.WeightMode `mode`: PARAMS (the trained params are the whole model: no LoRA),
    MERGED (LoRA adapters merged into a copy of the base: what a sampler without adapter
    support runs) or ADAPTERS_AND_BASE (the pair (adapters, frozen base), for a rollout that
    runs the adapters itself, mode.adapters)."""
    if not has_lora:
        return PARAMS
    return ADAPTERS_AND_BASE if mode.adapters else MERGED


# ------------------------------------------------------------------ resident memory

@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds of the training state, by part."""
    params: float  # the trained params (with LoRA: the adapters, counted as 0: they are tiny)
    moments: float  # AdamW's two moments, in the param dtype
    gradient: float  # one gradient of the trained params, while an update runs
    reference: float  # the reference copy (keeps_reference_copy), in the compute dtype
    frozen_base: float  # LoRA's frozen base: the compute dtype, or quant_bits per weight

    @property
    def resident(self) -> float:
        """What stays on the device between steps (the gradient is an update's temporary)."""
        return self.params + self.moments + self.reference + self.frozen_base

    @property
    def with_gradient(self) -> float:
        """resident plus the gradient: the state while an update runs."""
        return self.resident + self.gradient


def state_bytes(cfg: TrainConfig, weights: float) -> StateBytes:
    """The training state's bytes on one device that holds `weights` of the model's parameters
    (all of them when replicated; a layout's shard per device in aot.search). The one memory
    model of the state: train.choose_mesh sizes a default mesh with it, aot's layout search
    its resident part."""
    import jax.numpy as jnp  # here, not at import: aot sets up jax before its first use

    compute = jnp.dtype(cfg.numerics.dtype).itemsize
    if cfg.peft.use_peft:
        bits = cfg.peft.quant_bits or 8 * compute
        return StateBytes(0.0, 0.0, 0.0, 0.0, weights * bits / 8)
    param = weights * jnp.dtype(cfg.numerics.param_dtype).itemsize
    return StateBytes(param, 2 * param, param,
                      weights * compute if keeps_reference_copy(cfg) else 0.0, 0.0)
