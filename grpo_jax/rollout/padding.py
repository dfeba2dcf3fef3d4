"""Prompts as the padded arrays every rollout hands the trainer: left-padded rows, a group's rows
consecutive, widths from the length buckets (grpo_jax.shapes), so the train step sees a bounded
set of shapes whichever rollout made the batch; and completions cut to the width the trainer
pads them to (trim_completions)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax.shapes import bucket_width

# A RolloutBatch's fields laid out [N, C, ...] over the completion's positions.
COMPLETION_FIELDS = ("completion_ids", "completion_mask", "sampler_logp", "tool_mask",
                     "versions", "completion_routing", "completion_images")


def left_pad(prompts: Sequence[Sequence[int]], num_generations: int, width: int, pad_id: int,
             rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[rows, width] int32 ids and mask: each prompt left-padded, repeated num_generations
    times in one consecutive block (extra rows are all padding)."""
    g = num_generations
    ids = np.full((rows or len(prompts) * g, width), pad_id, np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i * g:(i + 1) * g, width - len(p):] = p
        mask[i * g:(i + 1) * g, width - len(p):] = 1
    return ids, mask


def bucketed_prompts(prompts: Sequence[Sequence[int]], num_generations: int, pad_id: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """left_pad to the smallest DEFAULT_BUCKETS width that fits, as the JAX sampler pads, so
    the train step sees a bounded set of shapes whichever rollout made the batch."""
    return left_pad(prompts, num_generations, bucket_width(max(map(len, prompts))), pad_id)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def trim_completions(batch, width: int):
    """A RolloutBatch with its completions cut to their first `width` positions (every token
    past them padding: grpo_jax.shapes.completion_width of the longest), the M-RoPE positions
    [N, 3, P + C] with them."""
    if width == batch.completion_ids.shape[1]:
        return batch
    if batch.completion_mask[:, width:].any():
        raise ValueError(f"trim_completions to {width} would cut completion tokens")
    cut = {f: getattr(batch, f)[:, :width] for f in COMPLETION_FIELDS
           if getattr(batch, f) is not None}
    if batch.positions is not None:
        cut["positions"] = batch.positions[..., :batch.prompt_ids.shape[1] + width]
    return batch._replace(**cut)
