"""The native JAX sampler as a rollout (`rollout.backend: jax`)."""

from __future__ import annotations

from grpo_jax.config.rollout import SamplingParams
from grpo_jax.rollout.base import Rollout, RolloutBatch, WeightMode
from grpo_jax.rollout.native import continuation, partial, refill
from grpo_jax.rollout.native.sampler import Sampler


class JaxRollout(Rollout):
    """The native sampler: it reads the trainer's params directly, so there is nothing to sync.

    With LoRA (`peft`) it reads the adapters and the frozen base (READ_ADAPTERS) where
    PeftArgs.sampler_takes_adapters says so (a quantized base); else the base with the adapters
    merged (READ), merged once per round.

    With `max_num_seqs` set, rounds run through that many decode slots
    (rollout/native/refill.py); with max_staleness >= 1 too, as partial rollouts
    (rollout/native/partial.py: `partial`, which the round drives instead of `generate`)."""

    def __init__(self, model_cfg, params: SamplingParams, *, pad_id: int, mesh, peft=None,
                 partial_rollouts: tuple[int, int, int] | None = None):
        adapters = bool(peft and peft.sampler_takes_adapters)
        self.weight_mode = WeightMode.READ_ADAPTERS if adapters else WeightMode.READ
        # A mixture of experts records its routing (router/mismatch, routing replay), through
        # decode slots (refill.py) and partial rollouts (partial.py) too.
        record = bool(model_cfg.num_experts)
        self.sampler = Sampler(model_cfg, params, pad_id=pad_id, mesh=mesh,
                               peft=peft if adapters else None, record_routing=record)
        self.slots = refill.Refill(self.sampler) if params.max_num_seqs is not None else None
        # (num_generations, groups a round, max_staleness): rounds of whole groups from rows
        # that carry over between rounds (rollout/native/partial.py).
        self.partial = (None if partial_rollouts is None else
                        partial.PartialRollouts(self.sampler, self.slots.slots, *partial_rollouts))
        # Multi-turn rollouts continue from the KV cache (None: sliding-window models, which
        # re-prefill every turn's context; and with decode slots, since continuing needs every
        # row's cache kept between turns: there each turn re-prefills its context, and a row
        # waiting for its tools has left its slot to the next row).
        self.turns = (continuation.Continuation(self.sampler)
                      if continuation.supported(self.sampler) and self.slots is None else None)

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        if self.slots is not None:
            return self.slots.generate(weights, prompt_ids, num_generations, key)
        return self.sampler.generate(weights, prompt_ids, num_generations, key)
