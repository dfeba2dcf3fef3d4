"""TRL's evaluation loop: at the steps its schedule names, generate completions for every prompt
of the eval split, score them and take the loss without an update; log the batches' means
under TRL's `eval_` names (eval_reward, eval_rewards/<f>/mean, eval_loss, eval_kl, ...).

As transformers' Trainer: `eval_strategy` 'steps' evaluates every `eval_steps` optimizer steps
(default: logging_steps; a fraction < 1 of the run's steps) and at the last step, 'epoch' at
the end of every epoch and of the run, `eval_on_start` before the first step; `eval_delay`
holds the first one back. As TRL's GRPOTrainer in eval mode: each eval batch holds
per_device_eval_batch_size completions per data-parallel shard, num_generations_eval per
prompt, is generated once with the current weights (no buffer, no reuse, no accumulation) and
its loss is one micro-batch's; the eval split is gone through whole, in an order shuffled with
the data seed (TRL's eval sampler always shuffles, whatever shuffle_dataset says: load_prompts).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from grpo_jax.metrics import Logged, MetricWindow, is_timing
from grpo_jax.config.run import EvalArgs


@dataclasses.dataclass(frozen=True)
class EvalSchedule:
    """At which optimizer steps a run evaluates (transformers' DefaultFlowCallback). Epochs are
    counted as the run counts them (config.BatchPlan.epoch): an epoch's micro_steps_per_epoch
    in windows of gradient_accumulation_steps, the last one partial if need be."""
    strategy: str
    every: int  # optimizer steps between evaluations ('steps')
    delay: float
    total_steps: int
    gradient_accumulation_steps: int
    micro_steps_per_epoch: int

    @property
    def updates_per_epoch(self) -> int:
        return max(-(-self.micro_steps_per_epoch // self.gradient_accumulation_steps), 1)

    def epoch(self, step: int) -> float:
        micro = max(self.micro_steps_per_epoch, 1)
        done, rest = divmod(step, self.updates_per_epoch)
        return done + min(rest * self.gradient_accumulation_steps, micro) / micro

    def _epochs_done(self, step: int) -> int:
        return step // self.updates_per_epoch

    def due(self, step: int) -> bool:
        """Whether the run evaluates right after reaching `step` (> 0)."""
        if self.strategy == "no" or not 0 < step <= self.total_steps:
            return False
        if self.strategy == "steps":
            return self.delay <= step and (step % self.every == 0 or step == self.total_steps)
        ends_epoch = self._epochs_done(step) > self._epochs_done(step - 1)
        return self.delay <= self.epoch(step) and (ends_epoch or step == self.total_steps)

    def next_due(self, step: int) -> int | None:
        """The first step after `step` that evaluates, or None."""
        if self.strategy == "no" or step >= self.total_steps:
            return None
        if self.strategy == "steps":
            nxt = self.every * (step // self.every + 1)
            while nxt < self.delay:
                nxt += self.every
        else:  # the step that ends the next epoch
            nxt = (self._epochs_done(step) + 1) * self.updates_per_epoch
            while self.epoch(nxt) < self.delay:
                nxt += self.updates_per_epoch
        nxt = min(nxt, self.total_steps)
        return nxt if self.due(nxt) else None


def schedule(cfg: EvalArgs, logging_steps: float, total_steps: int,
             gradient_accumulation_steps: int, micro_steps_per_epoch: int) -> EvalSchedule:
    steps = cfg.eval_steps if cfg.eval_steps is not None else logging_steps
    every = math.ceil(total_steps * steps) if steps < 1 else int(steps)  # transformers' rule
    return EvalSchedule(cfg.eval_strategy, max(every, 1), cfg.eval_delay, total_steps,
                        gradient_accumulation_steps, micro_steps_per_epoch)


@dataclasses.dataclass
class Evaluator:
    """Evaluates a state on `dataset` (a data.PromptDataset of the eval split). `round` is the
    run's round.GRPORound: its rollout, reward settings and current reference model serve
    evaluation too; `score` scores num_generations completions per prompt. Eval batches hold
    prompts_per_batch prompts; a short last one is filled from the start of the split (as
    accelerate's even_batches) up to a multiple of `rows_multiple` completions, the mesh's
    data-parallel size."""
    round: Any
    dataset: Any
    score: Callable
    num_generations: int
    prompts_per_batch: int
    rows_multiple: int = 1

    def batches(self) -> list[list[dict]]:
        order, g, p = self.dataset.order(0), self.num_generations, self.prompts_per_batch
        out = []
        for start in range(0, len(order), p):
            rows = list(order[start:start + p])
            while len(rows) * g % self.rows_multiple:
                rows.append(order[(len(rows) - (len(order) - start)) % len(order)])
            out.append([self.dataset.record(int(i)) for i in rows])
        return out

    def loss_weights(self, batches: int) -> list[int]:
        """transformers' eval_loss weights: each batch's loss repeated eval_batch_size (the
        global batch's completions) times, and the last batch's cut by accelerate's
        gather_for_metrics to len(eval dataset) % that (prompts counted against completions,
        as accelerate does with TRL's repeating sampler) when not 0. Exact with one
        data-parallel shard (TRL: one process); with several, each of TRL's processes has a
        loss of its own."""
        full = self.prompts_per_batch * self.num_generations
        weights = [full] * batches
        if batches and len(self.dataset) % full:
            weights[-1] = len(self.dataset) % full
        return weights

    def __call__(self, at, key) -> dict:
        """The eval metrics of the run state `at` (run_state.RunState: its params and
        reference), keyed as TRL logs them."""
        state = at.state
        t0 = time.perf_counter()
        host, device, rows = [], [], []
        weights = self.round.rollout_weights(state.params)  # with LoRA: merged once
        for b, records in enumerate(self.batches()):
            gen = self.round.generate_and_score(
                weights, records, jax.random.fold_in(key, b), reference=at.reference,
                num_generations=self.num_generations, score=self.score)
            device.append(self.round.policy.eval_metrics(state, gen.batch))
            host.append({k: v for k, v in gen.metrics.items() if not is_timing(k)})
            rows.append(gen.batch.size)
        for h, d in zip(host, jax.device_get(device)):
            h.update({k: float(v) for k, v in d.items()})
        losses = np.asarray([h.pop("loss") for h in host])
        metrics = mean_over_batches(host)
        # transformers' eval_loss: the batches' losses weighted (loss_weights), the non-finite
        # ones left out while any is finite (logging_nan_inf_filter).
        keep = np.isfinite(losses) if np.isfinite(losses).any() else np.ones(len(losses), bool)
        metrics["loss"] = float(np.average(losses[keep],
                                           weights=np.asarray(self.loss_weights(len(host)))[keep]))
        metrics["num_tokens"] = float(at.tokens_seen)  # TRL: the training tokens seen so far
        runtime = time.perf_counter() - t0
        out = {f"eval_{k}": v for k, v in metrics.items()}
        out.update(eval_runtime=runtime, eval_samples_per_second=sum(rows) / runtime,
                   eval_steps_per_second=len(rows) / runtime)
        return out


def mean_over_batches(batches: Sequence[dict]) -> dict:
    """TRL's eval log: each metric appended once per eval batch, then its mean over the values
    that are not NaN (None when there is none: grpo_jax.metrics)."""
    window = MetricWindow()
    for m in batches:
        window.add(Logged(m))
    return window.flush()
