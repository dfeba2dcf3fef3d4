"""Scoring a round: its completions decoded and every reward function run on them, the rows
spread over the processes and the scores gathered back (`RewardScorer`, what GRPORound calls);
the prompts and dataset columns repeated per completion (`reward_inputs`), as TRL hands them to
reward functions."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax import rewards as rewards_lib

# A record's fields never passed to reward functions as columns (TRL drops the same ones).
NOT_REWARD_COLUMNS = ("prompt", "prompt_ids", "completion", "completion_ids")


class Scores(NamedTuple):
    """What a round's scorer returns: [N, F] rewards (NaN: the function returned None) and what
    the completion log shows."""
    per_func: np.ndarray
    prompts: Sequence[Any] = ()
    texts: Sequence[str] = ()
    extra: dict = {}    # reward functions' log_extra columns, one value per completion
    metrics: dict = {}  # their log_metric values, averaged


def reward_inputs(records: Sequence[dict], num_generations: int) -> tuple[list, dict[str, list]]:
    """Prompts and extra columns repeated per completion (prompt i's group is consecutive)."""
    prompts = [r["prompt"] for r in records for _ in range(num_generations)]
    keys = [k for k in records[0] if k not in NOT_REWARD_COLUMNS] if records else []
    return prompts, {k: [r[k] for r in records for _ in range(num_generations)] for k in keys}


@dataclasses.dataclass
class RewardScorer:
    """Decodes a round's completions and scores them. Each process scores the rows its devices
    hold in the train batch; the scores are then gathered, since advantages compare a prompt's
    whole group. A reward function that fails on one process fails the round on all."""
    funcs: list
    tokenizer: Any
    mesh: Any
    num_generations: int

    trainer_state: Any = rewards_lib.NOT_STARTED  # set before each round (TRL's trainer_state)
    warned: set = dataclasses.field(default_factory=set)  # functions said to give no reward

    @property
    def names(self) -> list[str]:
        return rewards_lib.reward_names(self.funcs)

    def __call__(self, records, r) -> Scores:
        ids = [row[m.astype(bool)].tolist() for row, m in zip(r.completion_ids, r.completion_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        prompts, columns = reward_inputs(records, self.num_generations)
        columns.update(r.extra or {})  # a rollout_func's fields, as TRL passes them
        # With tools, TRL's completions: each row's turns as messages (calls and results too).
        completions = (r.completions if r.completions is not None
                       else rewards_lib.completions_for_rewards(prompts, texts))
        rows = dist.owned_rows(mesh_lib.batch_sharding(self.mesh, 1), len(ids))
        logs = rewards_lib.RewardLogs()

        def score():
            if not rows.size:
                return np.zeros((0, len(self.funcs)), np.float32)
            pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
            return rewards_lib.compute_rewards(self.funcs, pick(prompts), pick(completions),
                                               pick(ids), {k: pick(v) for k, v in columns.items()},
                                               trainer_state=self.trainer_state, logs=logs)
        per_func = dist.gather_rows(dist.together(score, rewards_lib.RewardError), rows, len(ids))
        # As TRL: a completion no function scored is warned about (every batch); a function
        # that scored nothing in a batch, once (a task's function may skip other tasks' rows).
        funcs, unscored = rewards_lib.missing_rewards(per_func, self.names, prompts, texts)
        if dist.is_main():
            for line in [v for k, v in funcs.items() if k not in self.warned] + unscored:
                print(f"warning: {line}", file=sys.stderr)
        self.warned.update(funcs)
        # What the functions logged, from every process (TRL gathers both too).
        logs = rewards_lib.RewardLogs.merged(dist.gather_objects((rows.tolist(), logs)), len(ids))
        return Scores(per_func, prompts, texts, logs.extra, logs.metric_means())
