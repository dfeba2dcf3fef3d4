"""Disaggregated rounds in a multi-process run (`rollout.sampler_process` with
`distributed.num_processes` > 1): every trainer process starts a sampler process of its own on
its host's sampler_devices (sampler_process.py), and the trainer's processes, one
multi-controller program over the other devices, train the groups all of them finished.

Which prompts each sampler decodes: the i-th new group of an advance goes to process
i mod P (P processes), so each host decodes a share of every batch drawn, and its partial
rollouts number their k-th group's draw P x k + p (PartialRollouts' `numbering`): the draw
number the one-process split gives that prompt, which keys its rows' tokens. So each row draws
the tokens it would draw in one sampler, and where every advance finishes what it draws (a
split run at max_staleness 1) the batch is the one-process split run's batch.

The multi-controller rule holds: the trainer's processes run the same programs in the same
order, since every host-side exchange below is a collective all of them call at the same point
of the round (SplitRollouts' start and collect, which GRPORound calls on every process alike):

- the weights: start gathers the trainer's params to every process's host
  (distributed.to_host: jax's process_allgather where the trainer's mesh shards them over
  processes, the local copy where they are replicated), and sends them to its own sampler;
- the finished groups: collect waits for its own sampler's, then gathers every process's
  (distributed.gather_objects) and interleaves them group by group in draw order (process p's
  j-th group at j x P + p), so every process holds the whole batch as in any multi-process
  round (each then puts its devices' rows);
- the rows left in flight stay per process: RunState.rows_in_flight is this host's share (its
  sampler's InFlight, host arrays, KV caches too). A checkpoint gathers every process's share
  to process 0, which writes them into the one rows_in_flight file, each under its process's
  prefix (`gathered`), and a resume reads back its own (`own`), with the same process count
  (checked). The queued batch is the same on every process and is saved as in one process.

A host's sampler that dies stops every trainer process at the next collect (each raises
SamplerProcessError together: distributed.raise_together, the dead one's message named), with
the last checkpoint standing, as in one process.

Every host's sampler returns prompts_per_generation / P groups an advance (its
PartialRollouts' `groups`), so each round gets a whole batch. The samplers' decode counts are
summed (merge_decode_metrics), the advance's seconds are the slowest host's.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from grpo_jax import distributed as dist
from grpo_jax.errors import SamplerProcessError
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.rollout.native.disaggregated import Collected, Queued
from grpo_jax.rollout.native.partial import InFlight
from grpo_jax.rollout.native.sampler import merge_decode_metrics
from grpo_jax.rollout.native.sampler_process import SamplerProcess, SamplerSpec

# RolloutBatch's per-row arrays a host's groups carry (tools and images are refused here).
_ROWS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
         "sampler_logp", "versions", "prompt_routing", "completion_routing")


def host_spec(spec: SamplerSpec) -> SamplerSpec:
    """`spec` (the run's sampler, its partial rollouts' groups already this host's share) with
    this process's draw numbering."""
    numbering = (jax.process_count(), jax.process_index())
    return spec._replace(settings={**spec.settings, "numbering": numbering})


class SamplerHosts:
    """SplitRollouts' contract across the trainer's processes: `sampler` (this process's own)
    advances this host's share of each batch (see the module's docstring)."""

    def __init__(self, sampler: SamplerProcess, num_generations: int):
        self.sampler, self.g = sampler, num_generations
        self.max_staleness = sampler.max_staleness
        self.hosts, self.me = jax.process_count(), jax.process_index()
        # A failed collect's error, the same on every process: raised again by every later
        # collect (as a failed advance stays running), with no collective.
        self._failed: Exception | None = None

    @property
    def running(self) -> bool:
        return self.sampler.running or self._failed is not None

    def start(self, params, in_flight: InFlight, records: Sequence[dict],
              data_rows: Sequence[int], version: int, key) -> float:
        """The whole weights on this host (a collective), this host's share of the new groups
        to its sampler."""
        host = dist.to_host(params)
        share = slice(self.me, None, self.hosts)
        return self.sampler.start(host, in_flight, list(records)[share], list(data_rows)[share],
                                  version, key)

    def collect(self) -> Collected:
        """This host's advance, and every host's finished groups as one batch (a collective)."""
        if self._failed is not None:
            raise self._failed
        t0 = time.perf_counter()
        try:
            mine, error = self.sampler.collect(), None
        except Exception as e:  # noqa: BLE001 - raised on every process just below
            mine, error = None, e
        try:  # a host's sampler that died stops every process here, with its message
            dist.raise_together(error, SamplerProcessError)
        except Exception as e:
            self._failed = e
            raise
        every = dist.gather_objects(mine.queued)
        waited = time.perf_counter() - t0
        records = [None] * sum(len(e.records) for e in every)
        for p, e in enumerate(every):
            records[p::self.hosts] = e.records
        merged = Queued(self.merged([e.rollout for e in every]), tuple(records),
                        _interleaved([e.data_rows for e in every]),
                        sum(e.dropped for e in every), max(e.took for e in every), waited)
        return Collected(mine.in_flight, merged)

    def merged(self, parts: list[RolloutBatch]) -> RolloutBatch:
        """The hosts' finished groups as one batch, group j of process p at j x P + p."""
        g = self.g
        fields = {}
        for name in _ROWS:
            xs = [getattr(r, name) for r in parts]
            if xs[0] is None:
                continue
            grouped = [x.reshape(-1, g, *x.shape[1:]) for x in xs]
            fields[name] = _interleaved(grouped).reshape(-1, *xs[0].shape[1:])
        return RolloutBatch(**fields, metrics=merge_decode_metrics([r.metrics for r in parts]))

    def close(self) -> None:
        self.sampler.close()


def _interleaved(parts: list[np.ndarray]) -> np.ndarray:
    """[n x len(parts), ...]: parts[p][j] at j x len(parts) + p (every part n long)."""
    return np.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])


def gathered(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's rows in flight (partial.to_arrays of its share) on every process, each
    under its process's prefix "p<i>/" (a collective)."""
    out = {}
    for p, share in enumerate(dist.gather_objects(arrays)):
        out.update({f"p{p}/{k}": v for k, v in share.items()})
    return out


def own(arrays: dict, processes: int) -> dict:
    """This process's share of `gathered(...)`'s arrays, saved by `processes` processes."""
    if processes != jax.process_count():
        raise ValueError(f"its rollouts in flight were split between {processes} processes' "
                         f"samplers; this run has {jax.process_count()}: resume with "
                         f"{processes} processes")
    prefix = f"p{jax.process_index()}/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}

