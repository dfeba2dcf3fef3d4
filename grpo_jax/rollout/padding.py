"""Prompts as the padded arrays every rollout hands the trainer: left-padded rows, a group's rows
consecutive, widths from the length buckets (grpo_jax.shapes), so the train step sees a bounded
set of shapes whichever rollout made the batch."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax.shapes import bucket_width


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
