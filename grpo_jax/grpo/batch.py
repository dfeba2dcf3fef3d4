"""The training batch: one typed pytree from the rollout to the loss."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from grpo_jax.grpo.packing import Packing

Array = Any  # np.ndarray on the host, jax.Array on the mesh


@struct.dataclass
class Batch:
    """N rows (completions; a prompt's generations are consecutive). A log-prob left None is
    not needed by the update: None is part of the pytree's structure, so jit compiles one
    program per combination and a forgotten field is a structure error, never a silent
    on-policy update."""

    prompt_ids: Array       # [N, P] int32, left-padded
    prompt_mask: Array      # [N, P] int32
    completion_ids: Array   # [N, C] int32, right-padded (shapes.completion_width)
    completion_mask: Array  # [N, C] int32, 1 up to and including the stop token
    truncated: Array        # [N] bool: no stop token within C tokens
    advantages: Array       # [N] fp32
    old_logp: Array | None = None      # [N, C] the policy at generation time (num_iterations > 1)
    ref_logp: Array | None = None      # [N, C] the reference model (beta > 0)
    sampler_logp: Array | None = None  # [N, C] the sampler's own log-probs
    # [N] fp32: TRL's num_items_in_batch (the generation batch's loss tokens) / its rows, on
    # every row (grpo.loss.num_items_per_row): the dapo / cispo / vespo denominator (dr_grpo's:
    # max_completion_length on every row). None: a step divides by its own loss tokens (the
    # same when a step is a whole generation batch; dr_grpo: by its rows x C).
    num_items: Array | None = None
    # [N, C] int32, multi-turn tool calling: 0 on tool-result tokens, which the model attends
    # to (completion_mask) but which carry no loss, KL or entropy (TRL's tool_mask).
    tool_mask: Array | None = None
    # A mixture of experts sampled natively: the sampler's top-k experts of each token per
    # sparse layer (RolloutBatch's), int8/int16, -1 where not recorded. The forwards run them
    # under routing replay (numerics.router_replay); router/mismatch compares with them.
    prompt_routing: Array | None = None      # [N, P, S, k]
    completion_routing: Array | None = None  # [N, C, S, k]
    # A vision-language model: each row's prompt images as its tower takes them (Gemma 3
    # [N, K, C, H, W]; Qwen-VL [N, K, P, C*T*P*P], each image's patches padded to P:
    # images.PromptPixels' rows), as many on every row so that a split keeps each row's with it.
    pixel_values: Array | None = None
    # [N, 3, P + C] int32 M-RoPE positions of prompt + completion (Qwen-VL: qwen_vl.rope_index).
    positions: Array | None = None
    # [N, C] bool: a tool result's image placeholders in the completion (RolloutBatch's), which
    # take the row's images after its prompt's; None: the completions are text.
    completion_images: Array | None = None
    # Qwen-VL: [N, K, 3] int32 each row's images' patch grids (t, h, w), (0, 0, 0) for a blank:
    # the tower lays each image out from its grid in the program.
    image_grid: Array | None = None
    # Padding-free (numerics.padding_free): where each completion token runs in the packed
    # rows of its micro-batch. Set by Policy just before a program runs (its leading axes are
    # packed rows, not the batch's: `rows` must not cut it).
    packing: Packing | None = None

    @property
    def size(self) -> int:
        return self.truncated.shape[0]

    def model_mask(self) -> Array:
        """[N, C]: the completion tokens the model wrote, which the loss and the completion
        metrics count (completion_mask without tool results)."""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask * self.tool_mask

    def rows(self, index) -> Batch:
        """The rows `index` (a slice or an index array) of every field."""
        return jax.tree.map(lambda x: x[index], self)

