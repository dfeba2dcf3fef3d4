"""The run loop's clock and logs (`RunLog`): TRL's metric window between two logs, each
step's step_time, the logging and saving schedules, the completions log and the count of
skipped updates. grpo_jax.train's loop hands it each round's result; it owns what is logged
and when.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
from tqdm.auto import tqdm

from grpo_jax import config as config_lib
from grpo_jax import distributed as dist
from grpo_jax import evaluation
from grpo_jax.checkpoint import committed_steps, last_good
from grpo_jax.errors import UpdatesSkippedError
from grpo_jax.logger import MetricsLogger
from grpo_jax.metrics import Logged, MetricWindow, host_seconds, timing


class RunLog:
    """TRL's metric buffer between two logs: every logging_steps optimizer steps (a fraction
    < 1: of the run's steps) it is averaged into one record of metrics.jsonl, TensorBoard,
    W&B and the console; a run's last steps are logged at its end (flush). `last`: the
    metrics last logged (the run's result, and what a checkpoint's meta keeps)."""

    def __init__(self, logger: MetricsLogger, run_args: config_lib.RunArgs,
                 plan: config_lib.BatchPlan, total_steps: int, num_prompts: int):
        self.logger, self.run_args, self.plan, self.num_prompts = (logger, run_args, plan,
                                                                   num_prompts)
        self.logs, self.saves = interval_schedules(run_args, plan, total_steps, num_prompts)
        self.skips = SkippedUpdates(run_args.max_consecutive_skipped_updates)
        self.window = MetricWindow()
        self.pending_time = 0.0  # of rounds without an update: TRL counts it in the next step's
        self.last: dict = {}

    @classmethod
    def open(cls, out: Path, run_args: config_lib.RunArgs, plan: config_lib.BatchPlan,
             total_steps: int, num_prompts: int, start_step: int) -> "RunLog":
        logger = MetricsLogger(out, run_args, total_steps=total_steps, start_step=start_step,
                               enabled=dist.is_main())
        return cls(logger, run_args, plan, total_steps, num_prompts)

    def round(self, at, result, first: int, *, generated: bool, started: float) -> None:
        """A round's result (round.RoundResult) logged: its completions, its generation's
        metrics once (TRL's buffer), each update's with its step_time, a record whenever the
        logging schedule is due. `at`: the run state after it; `first`: its step before it;
        `started`: when the round began (time.perf_counter)."""
        if self.run_args.log_completions and result.scores is not None:
            self.logger.log_completions(at.step, result.scores.prompts, result.scores.texts,
                                        result.rewards, result.advantages,
                                        extra=result.scores.extra)
        wall = time.perf_counter() - started
        metrics = dict(result.metrics)
        if generated:
            metrics[timing("host")] = host_seconds(metrics, wall)
        update_time = metrics.pop(timing("update"), 0.0)
        if generated:
            self.window.add(Logged(metrics, put={"num_tokens": at.tokens_seen}))
        # TRL's step_time: the step's micro-steps, the generation in its first one.
        self.pending_time += wall - update_time
        for i, logged in enumerate(result.step_metrics):
            share = update_time / result.updates
            self.window.step(logged._replace(append={
                **logged.append, "step_time": share + self.pending_time,
                timing("update"): share}))
            self.pending_time, step = 0.0, first + i + 1
            self.skips.note(step, logged)
            self.window.add(Logged(put={"epoch": self.plan.epoch(step, self.num_prompts)}))
            if self.logs.due(step) or (step == 1 and self.run_args.logging_first_step):
                self.last = self.logger.log(step, self.window.flush())
        self.logger.advance(at.step)

    def evaluation(self, step: int, metrics: dict) -> None:
        metrics["epoch"] = self.plan.epoch(step, self.num_prompts)
        self.logger.log_eval(step, metrics)

    def flush(self, step: int) -> None:
        """The steps since the last log (TRL: in its final summary)."""
        if self.window.steps:
            self.last = self.logger.log(step, self.window.flush())

    def close(self) -> None:
        self.logger.close()


def interval_schedules(run_args: config_lib.RunArgs, plan: config_lib.BatchPlan,
                       total_steps: int, num_prompts: int):
    """(logging, saving) schedules: transformers' logging_strategy / save_strategy with
    logging_steps / save_steps, epochs counted as evaluation's are (EvalSchedule)."""
    log_every, save_every = run_args.steps_of(total_steps)
    gas, micro = plan.gradient_accumulation_steps, plan.micro_steps_per_epoch(num_prompts)
    return (evaluation.EvalSchedule(run_args.logging_strategy, log_every, 0.0, total_steps, gas,
                                    micro),
            evaluation.EvalSchedule(run_args.save_strategy, save_every, 0.0, total_steps, gas,
                                    micro))


class SkippedUpdates:
    """Optimizer updates skipped in a row (optax.apply_if_finite: a non-finite loss or gradient
    leaves the state as it was), each said on one line: a run whose every update is skipped
    (non-finite weights or optimizer state, a learning rate of inf) would otherwise go on
    forever changing nothing. `bound`: max_consecutive_skipped_updates (0: no bound)."""

    def __init__(self, bound: int):
        self.bound, self.in_a_row, self.first = bound, 0, 0

    def note(self, step: int, logged) -> None:
        if not logged.count.get("skipped_updates"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.first = step if self.in_a_row == 1 else self.first
        if dist.is_main():  # above the progress bar, on a line of its own
            tqdm.write(f"grpo_jax.train: warning: step {step}'s update was skipped: its loss or "
                       f"gradients are not finite (NaN or inf), the weights stay as they were "
                       f"({self.in_a_row} in a row; max_consecutive_skipped_updates="
                       f"{self.bound or 'unbounded'})", file=sys.stderr)

    @property
    def exceeded(self) -> bool:
        return bool(self.bound) and self.in_a_row >= self.bound

    def error(self, params, directory) -> UpdatesSkippedError:
        """The run's end. Skips leave the weights as they were: finite weights are those of
        every checkpoint since the skips began; non-finite ones were made by the last update
        applied (step first - 1), so only the checkpoints before it are good."""
        what = (f"{self.in_a_row} updates in a row (steps {self.first}-"
                f"{self.first + self.in_a_row - 1}) were skipped because their loss or "
                f"gradients were not finite, so the run makes no progress "
                f"(max_consecutive_skipped_updates={self.bound})")
        if bool(_all_finite(params)):
            return UpdatesSkippedError(
                f"{what}; the weights are finite: check the rewards and the data; "
                f"{last_good(directory)}")
        bad = self.first - 1
        good = [s for s in committed_steps(directory) if s < bad]
        return UpdatesSkippedError(
            f"{what}; the weights are not finite since step {bad}'s update (a learning rate "
            "too high, a damaged optimizer state?); "
            + (f"last good checkpoint: {Path(directory) / str(good[-1])}: resume from it "
               f"(resume_from_checkpoint) with a lower learning_rate" if good else
               "no checkpoint before it: train afresh with a lower learning_rate"))


# Whether every leaf of a pytree of arrays is finite, on the arrays' devices.
_all_finite = jax.jit(lambda tree: jax.numpy.array(
    [jax.numpy.isfinite(x).all() for x in jax.tree.leaves(tree)]).all())
