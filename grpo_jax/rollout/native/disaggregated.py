"""Disaggregated rounds in one process (`rollout.sampler_devices`): partial rollouts
(partial.py) decode on a sampler mesh of their own while the trainer updates on the rest of the
devices. Round n trains on the groups the sampler finished for it, while the sampler's advance
for round n+1 runs beside it with the weights of version n: the trainer's params copied onto
the sampler mesh's shardings (jax.device_put: device to device, the idea of Tunix's
rl/reshard.py), then `advance` in a worker thread (JAX dispatches asynchronously and releases
the GIL while programs run, so the trainer's Python goes on).

Every token of a split run is thus at least one version old when it trains, and its version
says so: the advance for round n+1 records version n, and the round trains it as version n+1,
so staleness/* and the importance-sampling correction see the version the weights really had.
The bound stays partial rollouts' own: the sampler runs with max_staleness - 1, checked
against the version it decodes with, so no trained token is more than max_staleness versions
older than the weights that train it.

What the sampler finished and the trainer has not taken yet is `Queued`, part of the run
state (RunState.queued) and of each checkpoint: before a checkpoint, `collect` waits for the
advance running, so the run state saved is whole and a resumed run trains the very batch the
uninterrupted run would.

With dynamic sampling (round.py GRPORound.generate_split) a round whose queued batch holds too
few groups with signal runs the sampler's next advances at once, with its own weights (their
tokens train 0 versions old), until the batch is full; only then does the next round's advance
start beside the update.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Protocol, Sequence

import jax
import numpy as np

from grpo_jax import images
from grpo_jax import mesh as mesh_lib
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.rollout.native.partial import Advanced, InFlight, PartialRollouts


class Queued(NamedTuple):
    """RunState.queued: the groups the sampler finished for the next round to train (its
    Advanced less the rows left in flight, which are RunState.rows_in_flight), with their
    prompts' dataset rows, for a checkpoint."""
    rollout: RolloutBatch
    records: tuple  # the groups' prompt records, one per group
    data_rows: np.ndarray  # [groups] int64: the dataset row of each group's prompt
    dropped: int  # groups dropped for staleness and generated again by its advance
    # Timing only (a checkpoint keeps neither): the seconds the advance took, and those the
    # trainer waited for it (timing/generate and timing/idle_trainer of the round training it).
    took: float = 0.0
    waited: float = 0.0


class Collected(NamedTuple):
    in_flight: InFlight
    queued: Queued


class Split(Protocol):
    """A sampler a round ahead of the trainer: start an advance, collect it later. Two kinds:
    SplitRollouts (this process, a worker thread) and sampler_process.SamplerProcess (a
    process of its own)."""
    max_staleness: int

    @property
    def running(self) -> bool:
        """Whether an advance was started and not collected yet."""

    def start(self, params, in_flight: InFlight, records: Sequence[dict],
              data_rows: Sequence[int], version: int, key) -> float:
        """Advance `in_flight` with `records`' new groups under `params` (version `version`);
        returns the sampler's idle seconds since its last advance ended."""

    def collect(self) -> Collected:
        """The running advance's result, waiting for it. Its error is raised here, and again
        by every later collect: a failed advance stays running."""

    def close(self) -> None:
        """Release what runs the advances (nothing may be running)."""


def done_data_rows(at: InFlight, records: Sequence[dict], data_rows: Sequence[int],
                   done: Sequence[dict]) -> np.ndarray:
    """The dataset rows of an advance's finished groups `done` (records of `at` or the new
    `records`, whose rows are `data_rows`): matched by identity, the records being those
    objects."""
    rows_of = {id(r): int(i) for r, i in zip(at.records, at.data_rows) if r is not None}
    rows_of.update((id(r), int(i)) for r, i in zip(records, data_rows))
    return np.array([rows_of[id(r)] for r in done], np.int64)


class SplitRollouts:
    """`partial`'s advances (its sampler built on `mesh`, the sampler's devices) one at a time
    in a worker thread: start(...) then collect()."""

    def __init__(self, partial: PartialRollouts, mesh, max_staleness: int):
        # `partial` bounds staleness by the version it decodes with, one before the version
        # that trains its tokens: built with max_staleness - 1 (engines.make_rollout).
        self.partial, self.mesh, self.max_staleness = partial, mesh, max_staleness
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-jax-sampler")
        self._running: Future | None = None
        self._finished: float | None = None  # when the last advance ended (perf_counter)

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, params, in_flight: InFlight, records: Sequence[dict],
              data_rows: Sequence[int], version: int, key) -> float:
        """Copy `params` (the trainer's, version `version`) onto the sampler mesh and start
        advancing `in_flight` with `records`' new groups; returns how long the sampler was idle
        since its last advance ended (timing/idle_sampler)."""
        if self._running is not None:
            raise RuntimeError("an advance is already running: collect() it first")
        params = jax.device_put(params, mesh_lib.param_shardings(params, self.mesh))
        # The copy finishes before the trainer's next update may donate the buffers it reads.
        jax.block_until_ready(params)
        records, data_rows = list(records), list(data_rows)

        def work() -> tuple[Advanced, np.ndarray, float]:
            t0 = time.perf_counter()
            done = self.partial.advance(params, in_flight, records, data_rows, version, key)
            jax.block_until_ready(done.in_flight.rows)
            self._finished = time.perf_counter()
            return (done, done_data_rows(in_flight, records, data_rows, done.records),
                    self._finished - t0)

        now = time.perf_counter()
        idle = 0.0 if self._finished is None else max(now - self._finished, 0.0)
        self._running = self._pool.submit(work)
        return idle

    def collect(self) -> Collected:
        """The running advance's result (waiting for it: its error raised here)."""
        if self._running is None:
            raise RuntimeError("no advance is running")
        t0 = time.perf_counter()
        # A failed advance stays running: every later collect raises its error again, so no
        # checkpoint is written of a state whose next batch was lost (GRPORound.settle).
        done, data_rows, took = self._running.result()
        self._running = None
        waited = time.perf_counter() - t0
        queued = Queued(done.rollout, tuple(done.records), data_rows, done.dropped, took, waited)
        return Collected(done.in_flight, queued)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# RolloutBatch's optional arrays a queued batch may hold.
_OPTIONAL = ("prompt_routing", "completion_routing", "tool_mask", "tool_calls", "tool_failures",
             "pixel_values", "positions", "completion_images")


def to_arrays(q: Queued) -> dict[str, np.ndarray]:
    """Queued as named host arrays for a checkpoint (the records as their dataset rows)."""
    r = q.rollout
    out = {name: np.asarray(getattr(r, name)) for name in (
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
        "sampler_logp", "versions")}
    # A mixture of experts' routing record (routing replay) and, with tools, the tool loop's
    # fields (tool_mask, call counts): saved where the sampler made them.
    fields = r._asdict()
    out.update({name: np.asarray(fields[name]) for name in _OPTIONAL
                if fields[name] is not None})
    if r.completions is not None:  # the tool loop's messages (what rewards read; a tool's
        out["completions"] = images.json_bytes(r.completions)  # images in them as PNG)
    if r.image_grid is not None:  # Qwen-VL's grids of each row's images
        out["image_grid"] = np.asarray(r.image_grid, np.int32)
    out.update({f"metric/{k}": np.float64(v) for k, v in (r.metrics or {}).items()})
    out.update(data_rows=q.data_rows, dropped=np.int64(q.dropped))
    return out


def from_arrays(arrays: dict, record) -> Queued:
    """A checkpoint's Queued; `record(i)`: the dataset's record of row i."""
    a = {k: np.asarray(v) for k, v in arrays.items()}
    metrics = {k[len("metric/"):]: float(v) for k, v in a.items() if k.startswith("metric/")}
    completions, grid = a.get("completions"), a.get("image_grid")
    rollout = RolloutBatch(a["prompt_ids"], a["prompt_mask"], a["completion_ids"],
                           a["completion_mask"], a["truncated"], a["sampler_logp"],
                           metrics=metrics or None, versions=a["versions"],
                           completions=None if completions is None
                           else images.from_json_bytes(completions),
                           image_grid=grid,
                           **{name: a.get(name) for name in _OPTIONAL})
    return Queued(rollout, tuple(record(int(i)) for i in a["data_rows"]), a["data_rows"],
                  int(a["dropped"]))
