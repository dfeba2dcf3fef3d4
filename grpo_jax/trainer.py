"""The compiled, sharded programs of one run (`Trainer`) and the one owner of a round
(`GRPORound`), shared by `train` and `bench e2e`.

A round: generate -> score -> advantages -> reference / old log-probs -> optimizer updates ->
new weights to the sampler. The host never waits inside the update loop: the step metrics are
fetched once, after the round's last update.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax.grpo import advantages as adv_lib
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.optimizer import OptimizerConfig, make_optimizer
from grpo_jax.grpo.train_step import StepConfig, TrainState, completion_logps, train_step


class Trainer:
    """Holds the compiled step and log-prob programs for one model, optimizer and mesh."""

    def __init__(self, model, step_cfg: StepConfig, optim: OptimizerConfig, total_steps: int,
                 mesh: Mesh):
        self.cfg, self.mesh = step_cfg, mesh
        self.model_config = model.cfg
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.tx, schedule = make_optimizer(optim, total_steps)
        self.param_shardings = mesh_lib.param_shardings(params, mesh)
        # A copy: the step donates its state, which must not free the caller's model arrays.
        params = jax.device_put(params, self.param_shardings, may_alias=False)
        replicated = NamedSharding(mesh, P())
        abstract = jax.eval_shape(self._init, params)
        opt_shardings = optax.tree_map_params(
            self.tx, lambda _, sharding: sharding, abstract.opt_state, self.param_shardings,
            transform_non_params=lambda _: replicated)
        self.state_shardings = TrainState(self.param_shardings, opt_shardings, replicated)
        self.init_state = jax.jit(self._init, out_shardings=self.state_shardings)(params)

        def constrain(x):  # [k, rows, ...] micro-batch splits: rows on the batch axes
            return jax.lax.with_sharding_constraint(
                x, mesh_lib.logical_sharding(mesh, None, "batch", *[None] * (x.ndim - 2)))
        self._step = jax.jit(
            lambda state, batch: train_step(self.graphdef, self.tx, schedule, step_cfg, state,
                                            batch, constrain),
            out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
        self._logps = jax.jit(self._logps_fn, out_shardings=replicated)

    def _init(self, params) -> TrainState:
        return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32))

    def _logps_fn(self, params, batch: Batch):
        model = nnx.merge(self.graphdef, params)
        logp, _ = completion_logps(model, batch, self.cfg.temperature, self.cfg.logprob_chunk)
        return logp

    def shard_batch(self, batch: Batch) -> Batch:
        # Host arrays that every process holds whole; each process places its devices' rows.
        return jax.tree.map(lambda v: dist.shard_host_array(
            np.asarray(v), mesh_lib.batch_sharding(self.mesh, np.ndim(v))), batch)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One update; the metrics stay on the device (jax.device_get them when needed)."""
        return self._step(state, self.shard_batch(batch))

    def logps(self, params, batch: Batch) -> jax.Array:
        """Completion log-probs without gradients: old (num_iterations > 1) or reference."""
        seqs = batch.replace(old_logp=None, ref_logp=None, sampler_logp=None)
        return self._logps(params, self.shard_batch(seqs))


class Scores(NamedTuple):
    """What a round's scorer returns: [N, F] rewards (NaN: the function returned None) and what
    the completion log shows."""
    per_func: np.ndarray
    prompts: Sequence[Any] = ()
    texts: Sequence[str] = ()


class RoundResult(NamedTuple):
    state: TrainState
    metrics: dict
    scores: Scores
    rewards: np.ndarray
    advantages: np.ndarray


@dataclasses.dataclass
class GRPORound:
    """One round's wiring. `score(records, rollout_batch) -> Scores`; `reward_names` name its
    columns in the metrics; `plan` is the config's BatchPlan; `ref_params` None means beta 0."""
    trainer: Trainer
    rollout: Any  # grpo_jax.rollout.engines: generate(...), update_weights(params)
    plan: Any
    score: Callable[[Sequence[dict], Any], Scores]
    reward_names: Sequence[str]
    scale_rewards: str
    reward_weights: Sequence[float] | None
    ref_params: Any = None

    def __call__(self, state: TrainState, records: Sequence[dict], key) -> RoundResult:
        plan, trainer, g = self.plan, self.trainer, self.plan.num_generations
        t0 = time.perf_counter()
        r = self.rollout.generate(state.params, [rec["prompt_ids"] for rec in records], g, key)
        t1 = time.perf_counter()
        scores = self.score(records, r)
        rewards = adv_lib.combine_rewards(scores.per_func, self.reward_weights)
        advantages, stats = adv_lib.group_advantages(rewards, g, self.scale_rewards)
        batch = Batch(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                      r.truncated, np.asarray(advantages, np.float32),
                      sampler_logp=r.sampler_logp)
        t2 = time.perf_counter()
        if self.ref_params is not None:
            batch = batch.replace(ref_logp=np.asarray(trainer.logps(self.ref_params, batch)))
        # Old log-probs only when an update can see changed params (TRL's rule).
        if plan.num_iterations > 1 or plan.steps_per_generation > plan.gradient_accumulation_steps:
            batch = batch.replace(old_logp=np.asarray(trainer.logps(state.params, batch)))
        t3 = time.perf_counter()
        per_step = plan.micro_batch_size * plan.gradient_accumulation_steps
        step_metrics = []
        for _ in range(plan.num_iterations):
            for s in range(plan.generation_batch_size // per_step):
                state, m = trainer.step(state, batch.rows(slice(s * per_step, (s + 1) * per_step)))
                step_metrics.append(m)
        metrics = aggregate(jax.device_get(step_metrics))
        t4 = time.perf_counter()
        sync_time = self.rollout.update_weights(state.params)

        metrics.update(stats)
        for name, col in zip(self.reward_names, scores.per_func.T):
            ok = np.isfinite(col).any()
            metrics[f"rewards/{name}/mean"] = float(np.nanmean(col)) if ok else 0.0
            metrics[f"rewards/{name}/std"] = float(np.nanstd(col)) if ok else 0.0
        metrics.update(completion_metrics(batch))
        metrics["timing/generate"] = t1 - t0
        metrics["timing/logprobs"] = t3 - t2  # reference and old log-probs (0 when neither)
        metrics["timing/update"] = t4 - t3
        if sync_time is not None:
            metrics["timing/weight_sync"] = sync_time
        return RoundResult(state, metrics, scores, rewards, advantages)


def aggregate(step_metrics: Sequence[dict]) -> dict:
    """A round's per-update metrics -> one value each: extremes by min / max, skips summed,
    the rest averaged."""
    out = {}
    for k in step_metrics[0]:
        values = np.asarray([m[k] for m in step_metrics], np.float64)
        if k.endswith(("_min", "/min")):
            out[k] = float(values.min())
        elif k.endswith(("_max", "/max")):
            out[k] = float(values.max())
        elif k == "skipped_updates":
            out[k] = float(values.sum())
        else:
            out[k] = float(values.mean())
    return out


def completion_metrics(batch: Batch) -> dict:
    lengths = batch.completion_mask.sum(1)
    done = ~batch.truncated
    term = lengths[done] if done.any() else np.zeros(1)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(batch.truncated.mean()),
        "completions/mean_terminated_length": float(term.mean()),
        "num_tokens": float(batch.prompt_mask.sum() + lengths.sum()),
    }
