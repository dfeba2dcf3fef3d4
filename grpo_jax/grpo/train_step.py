"""The GRPO train step: a pure function from (state, batch) to (state, metrics), jitted and
sharded by grpo_jax.trainer.

Micro-batches run under `lax.scan`; the loss is accumulated as (numerator, denominator) and divided
once, so k micro-batches give the gradient of one big batch (see loss.py for each loss_type).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.logprobs import token_logprobs


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step's math needs: values taken from the run's settings, never defaults of
    their own (tests/test_config.py checks that each setting is declared once)."""
    loss: loss_lib.LossConfig
    temperature: float
    gradient_accumulation_steps: int
    logprob_chunk: int = 128  # sequence positions per log-softmax chunk (memory, not a setting)


class TrainState(NamedTuple):
    params: Any  # nnx.State of fp32 master params
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken (a skipped update counts too)


def completion_logps(model, batch: Batch, temperature: float, chunk: int):
    """Per-token log-probs (and entropies) of the completion tokens under `model`."""
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden, _ = model(ids, positions, mask)
    P_len, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    hidden = hidden[:, P_len - 1:P_len - 1 + C]  # position t predicts token t + 1
    return token_logprobs(hidden, model.head_weight(), batch.completion_ids, temperature,
                          chunk_size=chunk)


def _micro_loss(params, graphdef, cfg: StepConfig, mb: Batch):
    model = nnx.merge(graphdef, params)
    logp, entropy = completion_logps(model, mb, cfg.temperature, cfg.logprob_chunk)
    return loss_lib.grpo_loss_terms(logp, entropy, mb, cfg.loss)


def loss_and_grads(graphdef, cfg: StepConfig, params, batch: Batch,
                   constrain: Callable[[jax.Array], jax.Array] = lambda x: x):
    """Exact (loss, grads, metric sums) over `batch`, split into gradient_accumulation_steps
    micro-batches: numerators and gradients are summed, then divided once by the summed
    denominator (which depends on the masks only, never on the params). `constrain` lays out
    each [k, rows, ...] split (the trainer keeps rows on the batch axes)."""
    k = cfg.gradient_accumulation_steps
    micro = jax.tree.map(lambda x: constrain(x.reshape(k, x.shape[0] // k, *x.shape[1:])), batch)
    value_and_grad = jax.value_and_grad(_micro_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, numerator, sums, denom = carry
        (n, s), g = value_and_grad(params, graphdef, cfg, mb)
        d = loss_lib.loss_denominator(mb.completion_mask, mb.truncated, cfg.loss)
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


def train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
               cfg: StepConfig, state: TrainState, batch: Batch,
               constrain: Callable[[jax.Array], jax.Array] = lambda x: x):
    """One optimizer update over `batch` ([N, ...] arrays, N = micro-batches x micro size).
    `tx` skips non-finite updates (grpo.optimizer); the step counts them all the same, as
    TRL's global_step does, and reports the skip."""
    loss, grads, sums = loss_and_grads(graphdef, cfg, state.params, batch, constrain)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_state = TrainState(optax.apply_updates(state.params, updates), new_opt, state.step + 1)
    metrics = dict(loss_lib.finalize_metrics(sums))
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads),
                   skipped_updates=(new_opt.notfinite_count > 0).astype(jnp.int32),
                   learning_rate=schedule(state.step))
    return new_state, metrics
