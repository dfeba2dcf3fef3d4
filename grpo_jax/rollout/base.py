"""The rollout contract: what the trainer asks of every way of generating completions.

A rollout turns prompts into a `RolloutBatch`. Four kinds exist (rollout/engines.py builds them):
the native JAX sampler (`JaxRollout`), a vLLM server (`VLLMRollout`, through process 0 alone in
a multi-process run: `MainProcessRollout`), and wrappers around one of those: the multi-turn tool
loop (`ToolRollout`), a user's rollout_func (`CustomRollout`) and async rounds (`AsyncRollout`).

How a rollout gets the policy's weights is fixed when it is built (`WeightMode`): the trainer
reads `weight_mode` and hands over the weights in that form, and asks nothing else of it. This
module imports numpy only: the contract reads without the code behind it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, NamedTuple, Sequence

import numpy as np


class RolloutBatch(NamedTuple):
    """N = len(prompts) * num_generations rows; generations of one prompt are consecutive."""

    prompt_ids: np.ndarray       # [N, P] int32, left-padded with pad_id (P = the length bucket)
    prompt_mask: np.ndarray      # [N, P] int32
    completion_ids: np.ndarray   # [N, C] int32; the stop token is kept, then pad_id
    completion_mask: np.ndarray  # [N, C] int32; 1 up to and including the stop token
    truncated: np.ndarray        # [N] bool: no stop token within C tokens
    sampler_logp: np.ndarray     # [N, C] fp32 log_softmax(logits / T) of each token; 0 if masked
    # Multi-turn tool calling (grpo_jax.rollout.tools); None for single-turn rollouts.
    tool_mask: np.ndarray | None = None    # [N, C] int32: 0 on tool-result tokens, else 1
    completions: list | None = None        # [N] the turns as messages (TRL's completions)
    tool_calls: np.ndarray | None = None   # [N] int32: tool calls made
    tool_failures: np.ndarray | None = None  # [N] int32: of those, failed ones
    extra: dict | None = None  # a rollout_func's extra fields: reward-function keywords
    # The native sampler's counts for the metrics (decode_metrics): decode steps, slot occupancy.
    metrics: dict | None = None
    # Partial rollouts (rollout/native/partial.py): [N, C] int32, the weight version (round)
    # that drew each token (0 where masked); None: every token from the round's own weights.
    versions: np.ndarray | None = None
    # A mixture of experts on the native sampler: each token's top-k experts per sparse layer
    # (S of them) as the sampler ran it, int8 (int16 past 127 experts), -1 where no record
    # (padding, a last token never fed back): for routing replay and router/mismatch.
    prompt_routing: np.ndarray | None = None      # [N, P, S, k]
    completion_routing: np.ndarray | None = None  # [N, C, S, k]
    # A vision-language model on the native sampler: each row's prompt images
    # (images.PromptPixels' block of its prompt), their grids (Qwen-VL: [N, K, 3], each row's)
    # and the rows' M-RoPE positions over prompt + completion [N, 3, P + C] (Qwen-VL), for the
    # trainer's forwards.
    pixel_values: np.ndarray | None = None
    image_grid: np.ndarray | None = None
    positions: np.ndarray | None = None
    # [N, C] bool: the completion's image placeholders, a tool result's images' (after the
    # prompt's in pixel_values: rollout.tools); None: the completion is text (any rollout but
    # the tool loop's on a vision-language model).
    completion_images: np.ndarray | None = None


def sampling_params(cfg, tokenizer, generation_eos: Sequence[int] = ()):
    """The config's generation settings with TRL's EOS set added to the stop tokens: the
    tokenizer's EOS, then `generation_eos` (every `eos_token_id` of the model's
    generation_config.json: hf.generation_eos_ids), then the config's own stop_token_ids."""
    stops = dict.fromkeys([tokenizer.eos_token_id, *generation_eos,
                           *cfg.generation.stop_token_ids])
    return dataclasses.replace(cfg.generation,
                               stop_token_ids=tuple(t for t in stops if t is not None))


class WeightMode(enum.Enum):
    """How a rollout gets the policy's weights; fixed when it is built.

    READ: `generate` reads the full model's params (with LoRA, the adapters merged into the base:
    once a round). READ_ADAPTERS: `generate` reads the pair (LoRA adapters, frozen base), for a
    sampler that runs the adapters itself (a quantized base). PUSH and PUSH_ADAPTERS: the rollout
    holds its own weights (a server), so `update_weights` gets them after each update, full
    (LoRA merged) or as the pair; `generate` then gets None."""

    READ = "read"
    READ_ADAPTERS = "read_adapters"
    PUSH = "push"
    PUSH_ADAPTERS = "push_adapters"

    @property
    def pushed(self) -> bool:
        return self in (WeightMode.PUSH, WeightMode.PUSH_ADAPTERS)

    @property
    def adapters(self) -> bool:
        return self in (WeightMode.READ_ADAPTERS, WeightMode.PUSH_ADAPTERS)


class Rollout(abc.ABC):
    """Every rollout. `generate` is abstract, so a rollout that lacks it can't be built; the
    other methods' defaults are those of a rollout that generates when asked, on the weights it
    was last given. An implementation sets `weight_mode` in its constructor (engines.make_rollout
    checks it is a WeightMode before the run starts)."""

    weight_mode: WeightMode
    takes_records: bool = False  # generate also gets the raw dataset records (a rollout_func)
    generates_ahead: bool = False  # prefetch starts the next round's generation (async rounds)
    # A JAX sampler's KV-cache continuation of rows between tool turns
    # (rollout/native/continuation.py); None: each turn's whole context is prefilled again.
    turns: Any = None
    # The JAX sampler's partial rollouts (rollout/native/partial.py PartialRollouts), which
    # the round drives with the run state's rows in flight instead of calling generate; None:
    # every round generates its own batch whole.
    partial: Any = None
    # A vision-language model's HF processor (the JAX sampler's, a vLLM server rollout's),
    # which takes images in tool results (rollout.tools: their tokens, with_row_images), and
    # its model's image
    # placeholder id (the processor's own may be another, Gemma 3's begin-of-image); None: a
    # tool's image is refused.
    processor: Any = None
    image_token_id: int | None = None

    @abc.abstractmethod
    def generate(self, weights, prompt_ids: Sequence[Sequence[int]], num_generations: int, key,
                 records: Sequence[dict] | None = None) -> RolloutBatch:
        """num_generations completions of each prompt, in the order of `prompt_ids`. `weights`:
        the params in the form weight_mode names (None when they are pushed)."""

    def update_weights(self, weights, params) -> float | None:
        """After an update: `weights` in weight_mode's form, `params` the trainer's own (what a
        rollout that generates ahead keeps to score its batches with). The seconds a push took;
        None when nothing is pushed (the weights are read at generate)."""
        return None

    @property
    def sync_metrics(self) -> dict:
        """Metrics of the last update_weights (weight_sync/*, async/*)."""
        return {}

    def prefetch(self, records: Sequence[dict], num_generations: int, key) -> None:
        """Start generating the round of `records` before it is asked for (generates_ahead);
        the generate of the same prompts, group size and key returns it. Nothing to start for a
        rollout that generates when asked."""
        return None

    def generated_with(self) -> Any:
        """The trainer's params that generated the last batch when they are not the current
        ones (a batch generated ahead, on weights since updated); else None."""
        return None

    def generated_ahead(self, records: Sequence[dict], num_generations: int, key
                        ) -> tuple[Any, int] | None:
        """A checkpoint's batch in flight (of `records`, with that key) that a resume can
        generate again exactly: (the trainer's params that generated it, the weight versions
        between those and the current ones). None: not prefetched, or a rollout that holds its
        own weights (a resume generates it again on the current ones)."""
        return None

    def resume_ahead(self, params, weights, staleness: int, records: Sequence[dict],
                     num_generations: int, key) -> None:
        """A resumed run's batch in flight (generated_ahead's), prefetched again with `params`
        (as `weights`, in weight_mode's form), `staleness` versions before the current ones."""
        raise NotImplementedError(f"{type(self).__name__} generates nothing ahead")

    def with_row_images(self, batch: RolloutBatch, records: Sequence[dict]) -> RolloutBatch:
        """`batch` with each row's images those of its record (one per row: its prompt's, then
        its tool results', images.record_images) for the trainer's forwards. Only a rollout
        with a `processor` has them (rollout/row_images.py)."""
        raise NotImplementedError(f"{type(self).__name__} takes no images in tool results")

    def process_parts(self, tools: Sequence[str]) -> tuple[dict, Any]:
        """What a process of its own needs to build this rollout's partial rollouts again
        (rollout.sampler_process): the JAX sampler's settings, less the mesh, and its tool
        loop's TurnsSpec (None without tools; `tools` the names its functions were loaded by).
        Only the JAX sampler has them (config validation keeps the rest from asking)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in a sampler process")


class RolloutWrapper(Rollout):
    """A rollout around another (`inner`) that changes how generate works: the rest of the
    contract is the inner rollout's, forwarded here and nowhere else."""

    inner: Rollout

    @property
    def weight_mode(self) -> WeightMode:
        return self.inner.weight_mode

    @property
    def generates_ahead(self) -> bool:
        return self.inner.generates_ahead

    @property
    def takes_records(self) -> bool:
        return self.inner.takes_records

    @property
    def turns(self):
        return self.inner.turns

    def update_weights(self, weights, params) -> float | None:
        return self.inner.update_weights(weights, params)

    @property
    def sync_metrics(self) -> dict:
        return self.inner.sync_metrics

    def prefetch(self, records, num_generations, key) -> None:
        self.inner.prefetch(records, num_generations, key)

    def generated_with(self):
        return self.inner.generated_with()
