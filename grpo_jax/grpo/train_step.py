"""The GRPO train step: one jit-compiled, sharded function from (state, batch) to (state, metrics).

Micro-batches run under `lax.scan`; the loss is accumulated as (numerator, denominator) and divided
once, so k micro-batches give the gradient of one big batch (see loss.py for each loss_type).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax.config import OptimArgs
from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo.logprobs import token_logprobs

# Per-sample arrays of a batch; the optional ones may be absent.
BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
              "advantages")
OPTIONAL_KEYS = ("old_logp", "ref_logp", "sampler_logp")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    loss: loss_lib.LossConfig
    temperature: float = 1.0
    gradient_accumulation_steps: int = 1
    logprob_chunk: int = 128


class TrainState(NamedTuple):
    params: Any  # nnx.State of fp32 master params
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken (a skipped update counts too)


def make_schedule(cfg: OptimArgs, total_steps: int):
    """transformers' schedules: linear warmup, then constant, linear decay or cosine decay."""
    warm = cfg.num_warmup_steps(total_steps)
    rest = max(total_steps - warm, 1)
    lr = cfg.learning_rate
    after = {
        "constant": lambda: optax.constant_schedule(lr),
        "constant_with_warmup": lambda: optax.constant_schedule(lr),
        "linear": lambda: optax.linear_schedule(lr, 0.0, rest),
        "cosine": lambda: optax.cosine_decay_schedule(lr, rest),
    }[cfg.lr_scheduler_type]()
    if not warm:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


def make_optimizer(cfg: OptimArgs, total_steps: int):
    schedule = make_schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm else optax.identity(),
        optax.adamw(schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                    weight_decay=cfg.weight_decay),
    )
    return tx, schedule


def completion_logps(model, batch: dict, temperature: float, chunk: int):
    """Per-token log-probs (and entropies) of the completion tokens under `model`."""
    ids = jnp.concatenate([batch["prompt_ids"], batch["completion_ids"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["completion_mask"]], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = model(ids, positions, mask)
    P_len, C = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    hidden = hidden[:, P_len - 1:P_len - 1 + C]  # position t predicts token t + 1
    return token_logprobs(hidden, model.head_weight(), batch["completion_ids"], temperature,
                          chunk_size=chunk)


def _micro_loss(params, graphdef, cfg: StepConfig, mb: dict):
    model = nnx.merge(graphdef, params)
    logp, entropy = completion_logps(model, mb, cfg.temperature, cfg.logprob_chunk)
    numerator, sums = loss_lib.grpo_loss_terms(
        logp, mb.get("old_logp"), mb.get("ref_logp"), mb["advantages"], mb["completion_mask"],
        mb["truncated"], entropy, mb.get("sampler_logp"), cfg.loss)
    return numerator, sums


def loss_and_grads(graphdef, cfg: StepConfig, params, batch: dict, mesh: Mesh | None):
    """Exact (loss, grads, metric sums) over `batch`, split into gradient_accumulation_steps
    micro-batches: numerators and gradients are summed, then divided once by the summed
    denominator (which depends on the masks only, never on the params)."""
    k = cfg.gradient_accumulation_steps

    def split(x):
        x = x.reshape(k, x.shape[0] // k, *x.shape[1:])
        if mesh is not None:
            x = jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, P(None, mesh_lib.BATCH, *[None] * (x.ndim - 2))))
        return x
    micro = jax.tree.map(split, batch)
    value_and_grad = jax.value_and_grad(_micro_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, numerator, sums, denom = carry
        (n, s), g = value_and_grad(params, graphdef, cfg, mb)
        d = loss_lib.loss_denominator(mb["completion_mask"], mb["truncated"], cfg.loss)
        return (jax.tree.map(jnp.add, grads, g), numerator + n,
                loss_lib.merge_metric_sums(sums, s), denom + d), None

    first = jax.tree.map(lambda x: x[0], micro)
    zero_sums = loss_lib.empty_metric_sums(jax.eval_shape(
        lambda: _micro_loss(params, graphdef, cfg, first)[1]))
    init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), zero_sums,
            jnp.zeros((), jnp.float32))
    (grads, numerator, sums, denom), _ = jax.lax.scan(accumulate, init, micro)
    denom = jnp.maximum(denom, 1e-8)
    return numerator / denom, jax.tree.map(lambda g: g / denom, grads), sums


def train_step(graphdef, tx, cfg: StepConfig, state: TrainState, batch: dict, mesh: Mesh | None):
    """One optimizer update over `batch` ([N, ...] arrays, N = micro-batches x micro size)."""
    loss, grads, sums = loss_and_grads(graphdef, cfg, state.params, batch, mesh)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    # A non-finite gradient leaves params and optimizer state untouched; the step still counts
    # (as TRL's global_step does) and the skip is reported.
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa
    new_state = TrainState(keep(new_params, state.params), keep(new_opt, state.opt_state),
                           state.step + 1)
    metrics = dict(loss_lib.finalize_metrics(sums))
    metrics.update(loss=loss, grad_norm=grad_norm, skipped_updates=1 - finite.astype(jnp.int32))
    return new_state, metrics


class Trainer:
    """Holds the compiled step and log-prob programs for one model, optimizer and mesh."""

    def __init__(self, model, step_cfg: StepConfig, optim: OptimArgs, total_steps: int,
                 mesh: Mesh):
        self.cfg, self.mesh = step_cfg, mesh
        self.model_config = model.cfg
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.tx, self.schedule = make_optimizer(optim, total_steps)
        self.param_shardings = mesh_lib.param_shardings(params, mesh)
        # A copy: the step donates its state, which must not free the caller's model arrays.
        params = jax.device_put(params, self.param_shardings, may_alias=False)
        abstract = jax.eval_shape(self._init, params)
        self.state_shardings = TrainState(
            self.param_shardings,
            mesh_lib.like_params(abstract.opt_state, params, self.param_shardings, mesh),
            NamedSharding(mesh, P()))
        self.init_state = jax.jit(self._init, out_shardings=self.state_shardings)(params)
        self._step = jax.jit(
            lambda state, batch: train_step(self.graphdef, self.tx, step_cfg, state, batch, mesh),
            out_shardings=(self.state_shardings, NamedSharding(mesh, P())),
            donate_argnums=(0,))
        self._logps = jax.jit(self._logps_fn, out_shardings=NamedSharding(mesh, P()))

    def _init(self, params) -> TrainState:
        return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32))

    def _logps_fn(self, params, batch):
        model = nnx.merge(self.graphdef, params)
        logp, _ = completion_logps(model, batch, self.cfg.temperature, self.cfg.logprob_chunk)
        return logp

    def shard_batch(self, batch: dict) -> dict:
        # Host arrays that every process holds whole; each process places its devices' rows.
        return {k: dist.shard_host_array(np.asarray(v), mesh_lib.batch_sharding(self.mesh,
                                                                                np.ndim(v)))
                for k, v in batch.items()}

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        lr = self.schedule(int(state.step))  # the rate this update uses
        state, metrics = self._step(state, self.shard_batch(batch))
        metrics["learning_rate"] = lr
        return state, metrics

    def logps(self, params, batch: dict) -> jax.Array:
        """Completion log-probs without gradients: old (num_iterations > 1) or reference."""
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        return self._logps(params, self.shard_batch({k: batch[k] for k in keys}))
