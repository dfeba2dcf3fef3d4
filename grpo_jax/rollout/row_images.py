"""The images a rollout's rows carry for the trainer's forwards (RolloutBatch.pixel_values,
image_grid, positions), whichever backend sampled them: the JAX sampler's and a vLLM server's
rows take the same pixels and, for Qwen-VL, the same M-RoPE positions."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax import images
from grpo_jax.models import qwen_vl
from grpo_jax.rollout.base import RolloutBatch


def positions(model_cfg, pad_id: int, prompt_ids, prompt_mask, image_grid,
              completion_width: int, image_tokens=None, completion_images=None
              ) -> np.ndarray | None:
    """Qwen-VL's M-RoPE positions over prompt + completion (qwen_vl.row_positions) of rows
    whose prompts' image placeholders images.placeholders reads (image_tokens: per row, as it
    reads them; a placeholder elsewhere is text) and whose completions hold images where
    completion_images says (a tool result's); None for a model without M-RoPE."""
    if model_cfg.mrope_section is None:
        return None
    text = images.placeholders(prompt_ids, prompt_mask, model_cfg.vision.image_token_id,
                               pad_id, image_tokens)[1]
    return qwen_vl.row_positions(model_cfg.vision, text, prompt_mask, image_grid,
                                 completion_width, pad_id, completion_images)


def with_row_images(processor, model_cfg, pad_id: int, r: RolloutBatch,
                    records: Sequence[dict]) -> RolloutBatch:
    """`r` with each row's images those of its record (records[i], one per row: its prompt's,
    then its tool results', images.record_images), and Qwen-VL's positions over prompt +
    completion with its completion_images as images."""
    px = images.row_pixels(processor, [images.record_images(rec) for rec in records])
    return r._replace(pixel_values=px.pixel_values, image_grid=px.image_grid,
                      positions=positions(model_cfg, pad_id, r.prompt_ids, r.prompt_mask,
                                          px.image_grid, r.completion_ids.shape[1],
                                          [len(rec["prompt_ids"]) for rec in records],
                                          r.completion_images))
