"""Async rounds (`max_staleness >= 1` with vLLM rollouts, or with a rollout_func on the JAX
sampler): the server (or the JAX sampler, in a thread of this process) generates round n+1 while
the trainer trains on round n, as TRL's AsyncGRPOTrainer does with weight_sync_steps 1.

The JAX sampler reads its weights rather than being pushed them (WeightMode.READ): here
update_weights keeps a copy of each version's (the next update donates the trainer's buffers),
and the thread generates round n+1 with the copy of the version current when its prefetch began,
so a round's whole episodes (every generate call of the rollout_func) run on one version, as on
a server. JAX releases the GIL while its programs run, so the trainer's steps go on beside it.

train.py asks for round n+1's generation (`prefetch`) just before it runs round n, so the server
generates it with the weights pushed after round n-1 while round n is scored and trained. The push
after round n's update waits for that generation to end, then pauses the server (`mode=wait`),
loads the new weights and resumes. Every completion thus comes from one weight version, none sees
half-loaded weights, and round n+1 trains on a batch exactly one version old. The sampler's
log-probs (of the version that generated the batch) and TRL's importance-sampling correction
(vllm_importance_sampling_correction) weight it exactly; a batch more than max_staleness versions
old is thrown away and generated again.

With dynamic_sampling a round's fill takes as many generation batches as it needs, each asked
for in data order, and each starts the prefetch of the one after it (train.py Draws): `pending`
then holds the batches of the prompts the run reads next, and one the run went past (prefetched
before the batch it asks for, or left too old) is dropped and counted.

Several processes (a multi-controller run): process 0 alone generates ahead, with whole episodes
(its thread sends HTTP requests only: a collective there would misorder against the train step's),
while every process keeps the same bookkeeping below (versions, pending tags, the params of recent
versions, staleness, discarded counts), so all take the same decisions; the batch a round takes
is broadcast from process 0 in the main thread (a server error in the thread is raised there, on
every process), and a push gathers the params on every process before process 0 sends them.

Metrics: async/staleness (versions between generation and training: the oldest batch the round
took), async/discarded (prefetched batches thrown away), and wall
clock timestamps: timeline/next_generate_start and _end (the generation that ran during this
step's scoring and update, whose own timestamps GRPORound logs as timeline/train_start,
timeline/update_start and _end).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed as dist
from grpo_jax.errors import VLLMServerError
from grpo_jax.rollout.base import RolloutWrapper


def _tag(prompt_ids, num_generations: int, key) -> tuple:
    """What identifies a round's generation request: its prompts, group size and key."""
    data = np.asarray(jax.random.key_data(key)).tobytes()
    return tuple(map(tuple, prompt_ids)), num_generations, data


class AsyncRollout(RolloutWrapper):
    """A VLLMRollout (with its tool loop or rollout_func, if any: a round's whole episodes), or
    a JaxRollout inside a rollout_func's CustomRollout, whose next round can be generated ahead
    (`prefetch`). It keeps the trainer's params of each version a batch in flight may come
    from, so the trainer scores a batch with the weights that generated it (`generated_with`).

    `inner`: what every process calls in the main thread (a round's generation when none was
    prefetched, weight pushes): the rollout itself, or in a multi-process run the
    MainProcessRollout around process 0's. `ahead`: what this process's background thread
    generates with: the rollout itself; in a multi-process run process 0's (None elsewhere:
    those processes take the batch process 0 broadcasts)."""

    generates_ahead = True

    def __init__(self, inner, max_staleness: int, ahead, place=None):
        """`place`: the JAX sampler on devices of its own (sampler_devices): puts the trainer's
        weights onto the sampler's mesh (a device-to-device copy); None: it reads them where
        they are (a copy kept per version all the same)."""
        self.inner, self.max_staleness, self.ahead = inner, max_staleness, ahead
        self.place = place
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
        # tag -> (weight version at start, future of (batch, start, end), None on a process
        # that doesn't generate ahead); train.py asks for round n+1 before round n takes its
        # own, so two can be here at once.
        self.pending: dict[tuple, tuple] = {}
        self.latest = None  # the future of the last prefetch
        self.metrics: dict = {}
        self.discarded = 0
        # Weight versions: updates pushed so far; the trainer's params of the recent ones (the
        # next update donates the trainer's buffers: these are copies; with LoRA, adapters only).
        self.version, self.pushed = 0, {}
        self.staleness = 0
        # The staleness of each batch taken on weight version `taken[0]` (a fill takes several).
        self.taken: tuple[int, list[int]] = (0, [])
        # A rollout that reads its weights (the JAX sampler): the current version's, in its
        # weight_mode's form, copied (None for a server's: it holds its own).
        self.weights = None
        self.made: dict[tuple, int] = {}  # tag -> the version of each recent prefetch

    def prefetch(self, records, num_generations: int, key) -> None:
        """Start generating the round of `records` in the background; returns once it has
        begun. (The generation before it, which the round about to run needs, ends first: one
        thread. Waiting here costs that round nothing, and the next generation is under way
        before the trainer's work on it starts, however busy the host's CPUs are.)"""
        ids = [rec["prompt_ids"] for rec in records]
        self.latest = None if self.ahead is None else self._start(ids, num_generations, key,
                                                                    records)
        self.pending[_tag(ids, num_generations, key)] = (self.version, self.latest)
        self.made[_tag(ids, num_generations, key)] = self.version

    def _start(self, ids, num_generations: int, key, records) -> cf.Future:
        started = threading.Event()

        given = records if self.inner.takes_records else None  # a rollout_func reads them
        weights = self.weights  # this version's, whatever the updates meanwhile

        def run():
            start = time.time()
            started.set()
            batch = self.ahead.generate(weights, ids, num_generations, key, given)
            return batch, start, time.time()
        future = self.pool.submit(run)
        started.wait()
        return future

    def generate(self, weights, prompt_ids, num_generations, key, records=None):
        tag, order = _tag(prompt_ids, num_generations, key), list(self.pending)
        # Prefetched in data order, each before the batch ahead of it is asked for: those
        # before this one (before the latest, if this one was not prefetched) are of prompts
        # the run went past.
        for skipped in order[:order.index(tag) if tag in order else len(order) - 1]:
            future = self.pending.pop(skipped)[1]
            if future is not None:
                future.cancel()  # a no-op once it runs
            self.discarded += 1
        found = self.pending.pop(tag, None)
        if found is not None:
            staleness = self.version - found[0]
            if staleness <= self.max_staleness:
                # Process 0's batch on every process, in the main thread (one process: as is).
                batch = dist.from_main(lambda: found[1].result()[0], VLLMServerError)
                self._took(staleness)
                return batch
            self.discarded += 1  # too old: generated again below, on the current weights
        self._took(0)
        if self.place is not None and not self.weight_mode.pushed:
            weights = self.place(weights)
        return self.inner.generate(weights, prompt_ids, num_generations, key, records)

    def _took(self, staleness: int) -> None:
        if self.taken[0] != self.version:
            self.taken = (self.version, [])
        self.taken[1].append(staleness)
        self.staleness = staleness
        self.metrics["async/staleness"] = float(max(self.taken[1]))

    def generated_with(self):
        return self.pushed.get(self.version - self.staleness)

    def update_weights(self, weights, params) -> float:
        """Push after the generation in the background is done (the JAX sampler: copy the
        weights it will read). pause(mode=wait) alone would let requests that reach the server
        late (the background thread may send them after a short update began) wait out the
        push and run on the new weights, which would make a batch's version uncertain; waiting
        here keeps it exact (the push waits for that generation either way)."""
        self.metrics.pop("timeline/next_generate_start", None)
        self.metrics.pop("timeline/next_generate_end", None)
        if self.latest is not None:
            cf.wait([self.latest])
            if self.latest.exception() is None:
                _, start, end = self.latest.result()
                self.metrics["timeline/next_generate_start"] = start
                self.metrics["timeline/next_generate_end"] = end
            self.latest = None
        t0 = time.perf_counter()
        took = self.inner.update_weights(weights, params)  # every process (a gather)
        self.version += 1
        self.pushed[self.version] = kept = jax.tree.map(jnp.copy, params)
        if not self.weight_mode.pushed:  # read at generate: the copy the thread generates with
            if self.place is not None:  # onto the sampler's devices: a copy already
                self.weights = self.place(weights)
            else:
                self.weights = kept if weights is params else jax.tree.map(jnp.copy, weights)
            jax.block_until_ready(self.weights)
            took = time.perf_counter() - t0  # the copies are this rollout's weight sync
        for old in [v for v in self.pushed if v < self.version - self.max_staleness]:
            del self.pushed[old]
        for tag in [t for t, v in self.made.items() if v < self.version - self.max_staleness]:
            del self.made[tag]
        return took

    def generated_ahead(self, records, num_generations, key):
        """The params the batch of `records` (a checkpoint's in flight, prefetched; taken by a
        round a stop aborted, or not yet) was generated with, and the versions since, for a
        resume to generate it again exactly: the JAX sampler's only, the weights it reads
        being the trainer's; a server's is generated again on the current weights."""
        version = self.made.get(_tag([r["prompt_ids"] for r in records], num_generations, key))
        params = None if self.weight_mode.pushed else self.pushed.get(version)
        return None if params is None else (params, self.version - version)

    def resume_ahead(self, params, weights, staleness, records, num_generations, key) -> None:
        current = self.weights, self.version
        self.version -= staleness
        self.pushed[self.version] = params
        self.weights = weights if self.place is None else self.place(weights)
        self.prefetch(records, num_generations, key)  # tagged with that version
        self.weights, self.version = current

    @property
    def sync_metrics(self) -> dict:
        return {**self.inner.sync_metrics, **self.metrics, "async/discarded": self.discarded}
