"""Where a run stands (`RunState`): everything a checkpoint holds and a resume restores, as one
value. A round takes one and returns the next (grpo_jax.round.GRPORound); grpo_jax.train's
RunCheckpoints saves and restores it whole; nothing a resume needs lives anywhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_jax.data import DataPosition
from grpo_jax.grpo.batch import Batch


class AdaptersOff:
    """RunState.reference with LoRA: the reference is the base model with the adapters off, as
    TRL does with PEFT (no second copy of the model)."""


ADAPTERS_OFF = AdaptersOff()


@dataclasses.dataclass(frozen=True)
class RunState:
    """A run between two rounds (or two updates: a stop or a checkpoint may fall mid-round).

    `buffer` is TRL's generation buffer: micro-batches generated and not yet trained on (a
    window may span two generations, and max_steps or a checkpoint may end a round early);
    its first `epoch_end` micro-batches end an epoch (0: none), so the window that reaches them
    stops there. `reference`: None when there is no reference model (beta 0), ADAPTERS_OFF
    with LoRA, else the reference params (changed by sync_ref_model, so then checkpointed).
    `in_flight`: the generation batches drawn for rounds to come and not yet in the buffer,
    each as the (round, DataPosition of its prompts) that regenerate it exactly: async rounds
    (rollout.generates_ahead) generate the next round's batch beside this round's updates.
    A checkpoint keeps them; a resume draws them again from the same prompts and keys, so
    none is lost or trained twice. `rows_in_flight`: the JAX sampler's partial rollouts
    (rollout/native/partial.py InFlight: rows waiting, decoding with their KV caches, or done
    in groups not yet whole), carried from round to round and checkpointed whole; None without
    partial rollouts. `queued`: with sampler_devices (rollout/native/disaggregated.py Queued),
    the groups the sampler finished a round ahead and the next round trains; None while its
    advance runs (GRPORound.settle collects it before a checkpoint) or without a split.
    `generated_ahead`: below."""
    state: Any  # grpo.train_step.TrainState: params, optimizer state, step
    position: DataPosition = DataPosition()  # where the next generation's prompts start
    round: int = 0  # generation rounds completed (each round's sampling key is folded from it)
    tokens_seen: int = 0  # prompt + completion tokens generated (TRL's num_tokens)
    buffer: tuple[Batch, ...] = ()
    epoch_end: int = 0
    reference: Any = None
    in_flight: tuple = ()
    rows_in_flight: Any = None
    queued: Any = None
    # Async rounds on the JAX sampler, in a checkpoint and a resume only: the trainer's params
    # that generate the batch in flight (in_flight's) and the weight versions since
    # (Rollout.generated_ahead), so that a resume generates it again exactly; None: the batch
    # is generated again on the current weights (a server's, or none in flight).
    generated_ahead: Any = None

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped ones too, as transformers counts them)."""
        return int(self.state.step)

    def replace(self, **changes) -> "RunState":
        return dataclasses.replace(self, **changes)
