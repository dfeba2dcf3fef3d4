"""DAPO's dynamic sampling (arXiv 2503.14476; verl's `algorithm.filter_groups`): a generation
batch is filled with prompt groups whose rewards differ.

A group whose completions all score the same (reward std 0: all right or all wrong) has zero
advantages and teaches nothing, yet it dilutes the batch's token-level loss. GRPORound
(`generate_filled`) generates a batch, keeps its groups with signal (`groups_with_signal`),
and generates from the next prompts until `prompts_per_generation` groups are kept; the first
that many, in generation order, are the batch (verl drops the surplus too). Advantages,
num_items and the reference log-probs are then computed on that batch as on any other.

The kept rows of each generation are held here (`Filled`) only while the batch fills, inside
one round: a checkpoint never holds a half-filled batch. A run stopped or killed mid-fill
resumes from the data position before the batch and regenerates it with the same keys and
weights, so it fills the same way (JAX sampler; a vLLM server is as repeatable as its seeds).

With vLLM async rounds (max_staleness >= 1) the server generates ahead in data order: each
generation batch the fill reads starts the next one's prefetch (train.py Draws), so a batch
whose fill needs more finds the next one under way, and the next round's first batch is the one
after the last prompts this round read. A batch's sampling key is then its data position's
(`key_at`), which a prefetch knows before any fill asks; the fill's generations may come from
two weight versions (the first prefetched a round before), each kept with its rows (`Filled.
made_with`) for the trainer's log-probs under the weights that generated it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from grpo_jax import image_blocks
from grpo_jax.errors import NoSignalError
from grpo_jax.grpo import advantages as adv_lib
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.rollout.native.sampler import merge_decode_metrics


def groups_with_signal(per_func: np.ndarray, num_generations: int,
                       weights: Sequence[float] | None = None) -> np.ndarray:
    """[groups] bool: the groups whose weighted-sum rewards (NaN: unscorable, left out) have a
    std > 0, i.e. not TRL's is_std_zero (torch.isclose(std, 0)). A group with fewer than two
    scorable completions has no signal either (its advantages are all 0)."""
    rewards = adv_lib.combine_rewards(per_func, weights)
    std, is_zero = adv_lib.group_std(rewards, num_generations, "group")
    return (np.isfinite(std) & ~is_zero)[::num_generations]


def _rows(x: Any, rows: np.ndarray) -> Any:
    if x is None or (isinstance(x, (list, tuple)) and not x):  # Scores without texts: ()
        return x
    if isinstance(x, np.ndarray):
        return x[rows]
    if isinstance(x, dict):
        return {k: _rows(v, rows) for k, v in x.items()}
    return [x[i] for i in rows]


def _concat(parts: Sequence[Any], left_pad: bool = False, fill: int = 0) -> Any:
    """One field of several generations' rows: arrays stacked (prompt arrays left-padded with
    `fill` (0, masked; a routing record's -1, not recorded) to the widest), lists joined, dicts
    key by key."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, np.ndarray):
        if left_pad:
            width = max(p.shape[1] for p in parts)
            parts = [np.pad(p, ((0, 0), (width - p.shape[1], 0)) + ((0, 0),) * (p.ndim - 2),
                            constant_values=fill) for p in parts]
        return np.concatenate(parts)
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    return [x for p in parts for x in p]


def take_rows(batch: Any, rows: np.ndarray) -> Any:
    """The rows `rows` of a RolloutBatch or Scores (NamedTuples of per-row fields); Scores'
    metrics (per call, not per row) are kept as they are."""
    return batch._replace(**{k: _rows(v, rows) for k, v in batch._asdict().items()
                             if k != "metrics"})


def concat_rows(parts: Sequence[Any]) -> Any:
    """The rows of several RolloutBatches or Scores in order; the rollouts' decode counts are
    summed over their generate calls (the work all of them took), Scores' metrics averaged;
    rollouts' image blocks padded to the most per prompt (image_blocks.common)."""
    rollouts = isinstance(parts[0], RolloutBatch)
    if rollouts and parts[0].pixel_values is not None:
        blocks = image_blocks.common([(p.pixel_values, p.image_grid) for p in parts])
        parts = [p._replace(pixel_values=v, image_grid=g) for p, (v, g) in zip(parts, blocks)]
    fields = {k: _concat([p._asdict()[k] for p in parts], left_pad=k.startswith("prompt_"),
                         fill=-1 if k == "prompt_routing" else 0)
              for k in parts[0]._fields if k != "metrics"}
    if rollouts:
        fields["metrics"] = merge_decode_metrics([p.metrics for p in parts])
    elif "metrics" in parts[0]._fields:
        fields["metrics"] = {k: float(np.mean([p.metrics[k] for p in parts if k in p.metrics]))
                             for p in parts for k in p.metrics}
    return parts[0]._replace(**fields)


@dataclasses.dataclass
class Filled:
    """The groups kept so far for one batch of `num_prompts` groups of `num_generations`."""
    num_prompts: int
    num_generations: int
    rollouts: list = dataclasses.field(default_factory=list)  # kept rows of each generation
    scores: list = dataclasses.field(default_factory=list)
    generations: int = 0
    groups: int = 0  # generated
    with_signal: int = 0  # of those
    # Per generation: its kept rows and the trainer's params that generated it (Rollout.
    # generated_with: a batch generated ahead's; None: the current weights').
    made_with: list = dataclasses.field(default_factory=list)

    def add(self, rollout, scores, weights: Sequence[float] | None, made_with=None) -> None:
        keep = groups_with_signal(scores.per_func, self.num_generations, weights)
        rows = (np.flatnonzero(keep)[:, None] * self.num_generations
                + np.arange(self.num_generations)).ravel()
        self.made_with.append((rows.size, made_with))
        self.rollouts.append(take_rows(rollout, rows))
        self.scores.append(take_rows(scores, rows))
        self.generations += 1
        self.groups += keep.size
        self.with_signal += int(keep.sum())

    @property
    def full(self) -> bool:
        return self.with_signal >= self.num_prompts

    def batch(self) -> tuple[Any, Any]:
        """The first num_prompts kept groups: (RolloutBatch, Scores)."""
        n = np.arange(self.num_prompts * self.num_generations)
        return take_rows(concat_rows(self.rollouts), n), take_rows(concat_rows(self.scores), n)

    def batch_made_with(self) -> list[tuple[int, Any]]:
        """(rows, params that generated them) of the batch's rows in order, per generation."""
        left, parts = self.num_prompts * self.num_generations, []
        for n, params in self.made_with:
            parts.append((min(n, left), params))
            left -= parts[-1][0]
        return parts

    def metrics(self) -> dict:
        return {"dynamic_sampling/num_gen_batches": float(self.generations),
                "dynamic_sampling/filtered_frac": 1.0 - self.with_signal / self.groups}

    def no_signal(self) -> NoSignalError:
        return NoSignalError(
            f"dynamic_sampling: {self.generations} generation batches (max_num_gen_batches) "
            f"gave {self.with_signal} of the {self.num_prompts} prompt groups with reward std "
            f"> 0 that one batch needs ({self.groups} generated): the reward gives no signal, "
            "every completion of a prompt scores the same. Check the reward functions and the "
            "data's difficulty, or raise max_num_gen_batches (0: no limit)")


def key_for(key, generation: int):
    """The sampling key of a batch's `generation`-th generation: the round's own for the first
    (a batch that fills at once is the batch without dynamic sampling), then derived from it."""
    return key if generation == 0 else jax.random.fold_in(key, generation)


def key_at(key, position) -> Any:
    """With async rounds, the sampling key of the generation batch of prompts that starts at
    data position `position` (DataPosition): the prefetch and the fill that asks for the batch
    derive the same one, whichever round and generation of its fill it turns out to be."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, AHEAD_TAG),
                                                 position[0]), position[1])


AHEAD_TAG = 0x41484544  # "AHED": async fills' keys, apart from the rounds'
