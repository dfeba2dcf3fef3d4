"""How metrics become logged records, as TRL's GRPOTrainer and transformers' Trainer log them.

TRL keeps a buffer of lists (`GRPOTrainer._metrics`): each generation appends its metrics once,
each micro-batch its loss metrics once, each optimizer step its step_time; `log()`, called every
`logging_steps` optimizer steps, logs each list's mean over its values that are not NaN (None
when there is none) and clears the buffer. transformers adds the values it reads at that moment
(grad_norm, learning_rate, epoch) and the mean of the steps' losses. `MetricWindow` is that
buffer; each metric's aggregation is declared by the producer, by the group it puts it in
(`Logged`):
- `append`: TRL's `_metrics[name].append(v)` (a value or a list of values): logged as the mean
  of the window's values that are not NaN, None when there is none;
- `put`: the latest value is logged (transformers' grad_norm, learning_rate, epoch; TRL's
  `_metrics["num_tokens"] = [...]`);
- `count`: summed over the window (skipped_updates).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


# grpo-jax's own timing/* metrics: the seconds of a round's phases, each measured where it runs
# (the round times generate, logprobs, update and weight_sync; the training loop the rest, host).
# Every timing/* name is made here.
PHASES = ("generate", "logprobs", "update", "weight_sync", "host")
# The seconds of a round the sampler and the trainer each waited for the other (partial
# rollouts: one set of devices, so each waits while the other runs); overlapping the phases.
IDLE = ("idle_sampler", "idle_trainer")
_TIMING = "timing/"


def timing(phase: str) -> str:
    """The metric name of `phase`'s seconds."""
    if phase not in PHASES + IDLE:
        raise ValueError(f"{phase!r} is not a timed phase ({', '.join(PHASES + IDLE)})")
    return _TIMING + phase


def is_timing(name: str) -> bool:
    return name.startswith(_TIMING)


def host_seconds(metrics: dict, wall: float) -> float:
    """What of a round's `wall` seconds no timed phase took (prompts, decoding text, rewards,
    metrics): the host's share."""
    return wall - sum(metrics.get(timing(p), 0.0) for p in PHASES if p != "host")


class Logged(NamedTuple):
    """Metrics on their way into a MetricWindow, each in the group of its aggregation."""
    append: dict = {}
    put: dict = {}
    count: dict = {}


class MetricWindow:
    """The metrics of the optimizer steps since the last log (see the module docstring)."""

    def __init__(self):
        self._values: dict[str, list[float]] = {}
        self._put: dict[str, float] = {}
        self._count: dict[str, float] = {}
        self.steps = 0  # optimizer steps in the window

    def add(self, logged: Logged) -> None:
        for k, v in logged.append.items():
            vs = v if isinstance(v, Sequence) else [v]
            self._values.setdefault(k, []).extend(float(x) for x in vs)
        self._put.update({k: float(v) for k, v in logged.put.items()})
        for k, v in logged.count.items():
            self._count[k] = self._count.get(k, 0.0) + float(v)

    def step(self, logged: Logged = Logged()) -> None:
        """An optimizer step's metrics; the step counts towards the window."""
        self.add(logged)
        self.steps += 1

    def __bool__(self) -> bool:
        return bool(self.steps or self._values or self._put or self._count)

    def flush(self) -> dict[str, float | None]:
        """The window's record (TRL's `log()`), and an empty window."""
        out: dict[str, float | None] = {}
        for k, vs in self._values.items():
            valid = [v for v in vs if not math.isnan(v)]
            out[k] = sum(valid) / len(valid) if valid else None
        out.update(self._count)
        out.update(self._put)
        self.__init__()
        return out
