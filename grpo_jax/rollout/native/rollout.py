"""The native JAX sampler as a rollout (`rollout.backend: jax`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax import image_blocks, images
from grpo_jax.config.rollout import SamplingParams
from grpo_jax.rollout import row_images
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
    (rollout/native/partial.py: `partial`, which the round drives instead of `generate`).

    A vision-language model (`processor`: its HF processor) takes the round's records
    (`takes_records`): each prompt's images, in its multimodal messages, go through the
    processor's image processor and into the prefill; the batch carries them, row by row, for
    the trainer's forwards. Through static batches, refilled decode slots and partial
    rollouts (whose group slots keep their prompts' images across rounds), with tools too (each
    turn's context a prompt with its record's images, and a tool's images after them)."""

    def __init__(self, model_cfg, params: SamplingParams, *, pad_id: int, mesh, peft=None,
                 partial_rollouts: tuple[int, ...] | None = None, processor=None,
                 numbering: tuple[int, int] = (1, 0)):
        # What builds this rollout again elsewhere, less the mesh (a sampler process's).
        self.settings = dict(model_cfg=model_cfg, params=params, pad_id=pad_id, peft=peft,
                             partial_rollouts=partial_rollouts, processor=processor,
                             numbering=numbering)
        self.processor = processor
        self.image_token_id = None if processor is None else model_cfg.vision.image_token_id
        self.takes_records = processor is not None
        adapters = bool(peft and peft.sampler_takes_adapters)
        self.weight_mode = WeightMode.READ_ADAPTERS if adapters else WeightMode.READ
        # A mixture of experts records its routing (router/mismatch, routing replay), through
        # decode slots (refill.py) and partial rollouts (partial.py) too.
        record = bool(model_cfg.num_experts)
        self.sampler = Sampler(model_cfg, params, pad_id=pad_id, mesh=mesh,
                               peft=peft if adapters else None, record_routing=record)
        self.slots = refill.Refill(self.sampler) if params.max_num_seqs is not None else None
        # (num_generations, groups a round, max_staleness[, group slots]): rounds of whole
        # groups from rows that carry over between rounds (rollout/native/partial.py).
        self.partial = None
        if partial_rollouts is not None:
            g, k, bound, *group_slots = partial_rollouts
            self.partial = partial.PartialRollouts(
                self.sampler, self.slots.slots, g, k, bound, processor=processor,
                numbering=numbering, group_slots=group_slots[0] if group_slots else None)
        # Multi-turn rollouts continue from the KV cache (None: sliding-window models, which
        # re-prefill every turn's context; with decode slots, since continuing needs every
        # row's cache kept between turns: there each turn re-prefills its context, and a row
        # waiting for its tools has left its slot to the next row; and with images, whose
        # prefill Continuation's first turn lacks: each turn re-prefills the context with the
        # prompt's images, its M-RoPE positions those of the longer prompt).
        self.turns = (continuation.Continuation(self.sampler)
                      if continuation.supported(self.sampler) and self.slots is None
                      and processor is None else None)

    def process_parts(self, tools) -> tuple[dict, None]:
        return self.settings, None

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        if self.processor is not None:
            return self.generate_images(weights, prompt_ids, num_generations, key, records)
        if self.slots is not None:
            return self.slots.generate(weights, prompt_ids, num_generations, key)
        return self.sampler.generate(weights, prompt_ids, num_generations, key)

    def generate_images(self, weights, prompt_ids, num_generations, key, records
                        ) -> RolloutBatch:
        """generate for prompts with images: `records`' images (images.record_images: their
        multimodal prompts', then a tool loop's row's tool results') give the pixels."""
        px = images.row_pixels(self.processor, [images.record_images(rec) for rec in records])
        k = image_blocks.count(px.pixel_values)
        # Each prompt's block of k images (its own, then blanks), prompt after prompt; none:
        # the prompts are text.
        flat = px.pixel_values.reshape(-1, *px.pixel_values.shape[2:]) if k else None
        grid = None if px.image_grid is None or not k else px.image_grid.reshape(-1, 3)
        sampler = self.sampler if self.slots is None else self.slots
        # A tool turn's prompt is its record's prompt + the completion so far: only the
        # record's prompt and its tool results' image placeholders hold images, the rest is
        # text (as the trainer embeds it).
        limits = [images.image_tokens(rec) for rec in records]
        r = sampler.generate(weights, prompt_ids, num_generations, key, pixel_values=flat,
                             image_grid_thw=grid, image_tokens=limits, images_per_prompt=k)
        rows, grids = (None if a is None else np.repeat(a, num_generations, axis=0)
                       for a in (px.pixel_values, px.image_grid))
        positions = self.sampler.row_positions(r.prompt_ids, r.prompt_mask, grids,
                                               r.completion_ids.shape[1],
                                               [m for m in limits for _ in
                                                range(num_generations)])
        return r._replace(pixel_values=rows, image_grid=grids, positions=positions)

    def with_row_images(self, r: RolloutBatch, records: Sequence[dict]) -> RolloutBatch:
        return row_images.with_row_images(self.processor, self.sampler.cfg,
                                          self.sampler.pad_id, r, records)
