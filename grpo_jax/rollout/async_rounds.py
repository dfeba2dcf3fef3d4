"""Async rounds (`max_staleness >= 1` with vLLM rollouts): the server generates round n+1 while
the trainer trains on round n, as TRL's AsyncGRPOTrainer does with weight_sync_steps 1.

train.py asks for round n+1's generation (`prefetch`) just before it runs round n, so the server
generates it with the weights pushed after round n-1 while round n is scored and trained. The push
after round n's update waits for that generation to end, then pauses the server (`mode=wait`),
loads the new weights and resumes. Every completion thus comes from one weight version, none sees
half-loaded weights, and round n+1 trains on a batch exactly one version old. The sampler's
log-probs (of the version that generated the batch) and TRL's importance-sampling correction
(vllm_importance_sampling_correction) weight it exactly; a batch more than max_staleness versions
old is thrown away and generated again.

Metrics: async/staleness (versions between generation and training), async/discarded, and wall
clock timestamps: timeline/next_generate_start and _end (the generation that ran during this
step's scoring and update, whose own timestamps GRPORound logs as timeline/train_start,
timeline/update_start and _end).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import jax
import numpy as np


def _tag(prompt_ids, num_generations: int, key) -> tuple:
    """What identifies a round's generation request: its prompts, group size and key."""
    data = np.asarray(jax.random.key_data(key)).tobytes()
    return tuple(map(tuple, prompt_ids)), num_generations, data


class AsyncRollout:
    """A VLLMRollout whose next round can be generated ahead (`prefetch`)."""

    def __init__(self, inner, max_staleness: int):
        self.inner, self.max_staleness = inner, max_staleness
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="vllm-prefetch")
        # tag -> (weight version at start, future of (batch, start, end)); train.py asks for
        # round n+1 before round n takes its own, so two can be here at once.
        self.pending: dict[tuple, tuple] = {}
        self.latest = None  # the future of the last prefetch
        self.metrics: dict = {}
        self.discarded = 0

    def __getattr__(self, name):  # takes_adapters, syncs_weights, weights, ...: the inner's
        return getattr(self.inner, name)

    def prefetch(self, records, num_generations: int, key) -> None:
        """Start generating the round of `records` in the background."""
        ids = [rec["prompt_ids"] for rec in records]

        def run():
            start = time.time()
            batch = self.inner.generate(None, ids, num_generations, key)
            return batch, start, time.time()
        self.latest = self.pool.submit(run)
        self.pending[_tag(ids, num_generations, key)] = (self.inner.weights.count, self.latest)

    def generate(self, params, prompt_ids, num_generations, key):
        found = self.pending.pop(_tag(prompt_ids, num_generations, key), None)
        if found is not None:
            batch, _, _ = found[1].result()
            staleness = self.inner.weights.count - found[0]
            if staleness <= self.max_staleness:
                self.metrics["async/staleness"] = float(staleness)
                return batch
            self.discarded += 1  # too old: generated again below, on the current weights
        self.metrics["async/staleness"] = 0.0
        return self.inner.generate(params, prompt_ids, num_generations, key)

    def update_weights(self, params) -> float:
        """Push after the generation in the background is done. pause(mode=wait) alone would
        let requests that reach the server late (the background thread may send them after a
        short update began) wait out the push and run on the new weights, which would make a
        batch's version uncertain; waiting here keeps it exact (the push waits for that
        generation either way)."""
        self.metrics.pop("timeline/next_generate_start", None)
        self.metrics.pop("timeline/next_generate_end", None)
        if self.latest is not None:
            cf.wait([self.latest])
            if self.latest.exception() is None:
                _, start, end = self.latest.result()
                self.metrics["timeline/next_generate_start"] = start
                self.metrics["timeline/next_generate_end"] = end
            self.latest = None
        return self.inner.update_weights(params)

    @property
    def sync_metrics(self) -> dict:
        return {**self.inner.sync_metrics, **self.metrics, "async/discarded": self.discarded}
