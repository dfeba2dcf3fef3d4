"""The policy being trained: its compiled, sharded programs (`PolicyPrograms`, built by
`build_programs` from concrete params here and from abstract ones by grpo_jax.aot) and `Policy`,
which runs them on host batches: the update, old / reference log-probs, evaluation and the
reference mix. grpo_jax.round drives it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_jax import distributed as dist
from grpo_jax import mesh as mesh_lib
from grpo_jax import run_facts
from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo import packing
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.optimizer import OptimizerConfig, make_optimizer
from grpo_jax.grpo.train_step import (StepConfig, TrainState, batch_loss,
                                      completion_logps_and_router, init_train_state,
                                      state_shardings, train_step)
from grpo_jax.config import BatchPlan, TrainConfig
from grpo_jax.errors import GrpoJaxError
from grpo_jax.models import lora, moe
from grpo_jax.run_state import ADAPTERS_OFF


def step_config(cfg: TrainConfig, plan: BatchPlan, model_cfg) -> StepConfig:
    """The step's math settings of a run (train, bench and aot alike)."""
    loss = cfg.loss
    if cfg.numerics.replay and not model_cfg.num_experts:
        raise GrpoJaxError(f"router_replay {cfg.numerics.router_replay} replays a mixture of "
                           f"experts' routing, but the model ({model_cfg.model_type}) is dense: "
                           "set router_replay: disabled")
    if (cfg.rollout.backend != "vllm" and not loss.native_importance_sampling_correction
            and not cfg.rollout.max_staleness):
        # The JAX sampler runs the trainer's own weights: its log-probs only feed the metrics
        # (and rollout_rs's mask, when set), unless native_importance_sampling_correction.
        # Its partial rollouts (max_staleness) do not: their tokens come from older weights.
        loss = dataclasses.replace(loss, vllm_importance_sampling_correction=False)
    return StepConfig(loss=loss, temperature=cfg.generation.temperature,
                      gradient_accumulation_steps=plan.gradient_accumulation_steps,
                      dropout_seed=cfg.data.seed, aux_loss_coef=moe.router_aux_loss_coef(
                          cfg.loss.router_aux_loss_coef, model_cfg))


@dataclasses.dataclass(frozen=True)
class SplitPolicy:
    """A model as the programs take it: its graph, the params that train and what stays
    frozen."""
    graphdef: Any
    params: Any  # the trained params: the model's; with LoRA, its adapters
    frozen: tuple  # with LoRA (the frozen base, quantized or not,); else ()
    lora_scale: float | None


def split_policy(model, mesh: Mesh | None = None) -> SplitPolicy:
    """`model` (concrete, or abstract from models.build) split into the trained params and the
    frozen base, its activations laid out on `mesh`: the one split of Policy, aot and a
    checkpoint's restore target. A model with LoRA adapters (models/lora.py) trains only them:
    the state's params (and so the optimizer state, gradients and checkpoints) are the
    adapters."""
    if mesh is not None:
        model.shard_activations(mesh)
    scale = lora.scale_of(model)
    if scale is None:
        graphdef, params = nnx.split(model, nnx.Param)
        return SplitPolicy(graphdef, params, (), None)
    graphdef, params, base = nnx.split(model, lora.LoraParam, nnx.Param)
    return SplitPolicy(graphdef, params, (base,), scale)


def frozen_parts(params) -> tuple[str, ...]:
    """The parts of the trained params (top-level names) the optimizer never updates: a
    vision-language model's tower (`vision/*`), as TRL's vision-language recipes train the
    language model only; its forwards take no gradient into it (Decoder.embed_multimodal's
    frozen_tower). It stays in the state, so checkpoints and exports hold the whole model.
    A LoRA run's params are its adapters: the tower's (models/lora.py, as PEFT adapts them)
    are trained."""
    if "vision" not in params:
        return ()
    leaves = jax.tree.leaves(params["vision"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    return () if all(isinstance(x, lora.LoraParam) for x in leaves) else ("vision",)


def state_init(loss: loss_lib.LossConfig, optim: OptimizerConfig, total_steps: int,
               frozen: tuple[str, ...] = ()):
    """(optimizer, schedule, params -> TrainState): the one definition of a fresh state, for
    the programs and for a checkpoint's restore target. `frozen`: frozen_parts of the params."""
    tx, schedule = make_optimizer(optim, total_steps, frozen)

    def init(params) -> TrainState:
        return init_train_state(params, tx.init(params), loss)
    return tx, schedule, init


@dataclasses.dataclass(frozen=True)
class PolicyPrograms:
    """The jitted programs of one model graph, optimizer and mesh, and the layouts they run on.
    build_programs makes them from concrete params (Policy) or abstract ones (grpo_jax.aot,
    which lowers these very programs for a target it does not have)."""
    tx: optax.GradientTransformation
    param_shardings: Any
    state_shardings: Any
    init: Callable  # params (donated) -> TrainState
    step: Callable  # (state (donated), batch, frozen, group, k) -> (state, metrics)
    # (graphdef, params, batch, frozen, group) -> ([rows, C] log-probs, router/mismatch's
    # [2] sums or None without a routing record)
    logps: Callable
    eval: Callable  # (state, batch, frozen, group) -> loss metrics
    mix: Callable  # (params, ref (donated), alpha, 1 - alpha) -> ref


def build_programs(graphdef, params, step_cfg: StepConfig, optim: OptimizerConfig,
                   total_steps: int, mesh: Mesh) -> PolicyPrograms:
    """The programs of the model `graphdef` whose trained params are `params` (with LoRA the
    adapters; the frozen base is an argument of each program), laid out on `mesh` by its rules."""
    tx, schedule, init = state_init(step_cfg.loss, optim, total_steps, frozen_parts(params))
    param_sh = mesh_lib.param_shardings(params, mesh)
    replicated = NamedSharding(mesh, P())
    abstract = jax.eval_shape(init, params)
    # Optimizer moments are laid out like their params.
    # A frozen part's moments are optax.MaskedNode (none): kept as they are (frozen_parts).
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    opt_sh = optax.tree_map_params(
        tx, lambda x, sharding: x if masked(x) else sharding, abstract.opt_state, param_sh,
        transform_non_params=lambda _: replicated, is_leaf=masked)
    state_sh = state_shardings(step_cfg.loss, param_sh, opt_sh, replicated)

    def constrain(x):  # [k, rows, ...] micro-batch splits: rows on the batch axes
        return jax.lax.with_sharding_constraint(
            x, mesh_lib.logical_sharding(mesh, None, "batch", *[None] * (x.ndim - 2)))

    def logps(graphdef, params, batch: Batch, frozen=(), group: int = 1):
        model = nnx.merge(graphdef, params, *frozen)
        logp, _, _, mismatch = completion_logps_and_router(
            model, batch, step_cfg.temperature, step_cfg.logprob_chunk, group)
        return logp, mismatch
    return PolicyPrograms(
        tx, param_sh, state_sh,
        init=jax.jit(init, out_shardings=state_sh, donate_argnums=(0,)),
        step=jax.jit(lambda state, batch, frozen, group, k: train_step(
            graphdef, tx, schedule, step_cfg, state, batch, constrain, frozen, group, k),
            out_shardings=(state_sh, replicated), donate_argnums=(0,), static_argnums=(3, 4)),
        logps=jax.jit(logps, out_shardings=replicated, static_argnums=(0, 4)),
        eval=jax.jit(lambda state, batch, frozen, group: batch_loss(
            graphdef, step_cfg, state, batch, frozen, group), out_shardings=replicated,
            static_argnums=(3,)),
        # The reference's buffers are donated: the mix replaces them in place on the devices.
        mix=jax.jit(mix_params, out_shardings=param_sh, donate_argnums=(1,)))


class Policy:
    """The policy being trained: its programs (PolicyPrograms) for one model, optimizer and
    mesh, its initial train state and, with LoRA, the frozen base (`self.frozen`, an argument of
    the programs that is never donated or updated); its step, log-prob, evaluation and
    reference-mix calls on host batches."""

    def __init__(self, model, step_cfg: StepConfig, optim: OptimizerConfig, total_steps: int,
                 mesh: Mesh):
        self.cfg, self.mesh = step_cfg, mesh
        self.model_config = model.cfg
        # The update packs only without LoRA dropout, whose masks are drawn per row.
        self.trains_packed = model.lora_dropout == 0
        split = split_policy(model, mesh)
        self.graphdef, self.lora_scale = split.graphdef, split.lora_scale
        self.frozen: tuple = ()
        if split.frozen:
            self.base_shardings = mesh_lib.param_shardings(split.frozen[0], mesh)
            self.frozen = (jax.device_put(split.frozen[0], self.base_shardings),)
            self._merge = jax.jit(lambda base, adapters: lora.merge_into_base(
                base, adapters, self.lora_scale))
        self.programs = build_programs(self.graphdef, split.params, step_cfg, optim,
                                       total_steps, mesh)
        # A copy: the step donates its state, which must not free the caller's model arrays.
        # Copied after placing: device_put(may_alias=False) still hands back the caller's buffer
        # for a replicated array that already sits on one of the mesh's devices.
        params = jax.tree.map(lambda x, s: jax.device_put(x, s).copy(), split.params,
                              self.programs.param_shardings)
        if self.lora_scale is not None:
            # The reference runs the same program with every adapter at zero: x W + (x A) 0 is
            # x W exactly, and the base (quantized or not) is shared, never copied.
            self.adapters_off = jax.tree.map(jnp.zeros_like, params)
        # The copy is donated: the state's params take its buffers, not a third copy.
        self.init_state = self.programs.init(params)

    @property
    def param_shardings(self):
        return self.programs.param_shardings

    @property
    def shared_prefix(self) -> bool:
        """numerics.shared_prefix: prompts computed once per group (Decoder.shared_prefix)."""
        return self.model_config.numerics.shared_prefix

    @property
    def replays_routing(self) -> bool:
        """numerics.router_replay R3: the forwards run the sampler's recorded experts."""
        return self.model_config.numerics.replay

    def prompt_group(self, batch: Batch, micro_rows: int) -> int:
        """Rows per shared prompt for the programs (completion_logps' `group`) in micro-batches
        of `micro_rows` rows: run_facts.prompt_group of the blocks of one prompt the batch
        holds (1: none, or numerics.shared_prefix off). Read from the host batch, which every
        process holds whole, so all compile the same program."""
        blocks = prompt_blocks(batch) if self.shared_prefix else 1
        return run_facts.prompt_group(self.shared_prefix, blocks, micro_rows)

    def packed(self, batch: Batch, micro_batches: int, group: int, training: bool) -> Batch:
        """`batch` with its completions' packing (numerics.padding_free, grpo/packing.py) for
        programs that split it into `micro_batches` with `group` rows per shared prompt; as it
        is where padding-free is off or packs nothing, or the batch is not plain text with
        full attention on one sequence shard (images, M-RoPE positions, a routing record,
        sliding-window layers, a context axis: those run padded), and no expert capacity
        (moe_capacity_factor sizes it by the tokens a forward holds, padding included)."""
        cfg = self.model_config
        if (not cfg.numerics.padding_free or group < 2 or (training and not self.trains_packed)
                or not packing.packable(batch) or cfg.numerics.moe_capacity_factor is not None
                or any(cfg.sliding_layers) or mesh_lib.context_size(self.mesh) > 1):
            return batch
        return batch.replace(packing=packing.plan(batch.completion_mask, micro_batches, group,
                                                  mesh_lib.batch_divisor(self.mesh)))

    def shard_batch(self, batch: Batch) -> Batch:
        # Host arrays that every process holds whole; each process places its devices' rows.
        return jax.tree.map(lambda v: dist.shard_host_array(
            np.asarray(v), mesh_lib.batch_sharding(self.mesh, np.ndim(v))), batch)

    def step(self, state: TrainState, batch: Batch,
             micro_batches: int | None = None) -> tuple[TrainState, dict]:
        """One update over `batch` in `micro_batches` micro-batches (default
        gradient_accumulation_steps; fewer in the window that ends an epoch); the metrics stay
        on the device (jax.device_get them when needed)."""
        k = micro_batches or self.cfg.gradient_accumulation_steps
        group = self.prompt_group(batch, batch.size // k)
        batch = self.packed(batch, k, group, training=True)
        return self.programs.step(state, self.shard_batch(batch), self.frozen, group, k)

    def eval_metrics(self, state: TrainState, batch: Batch) -> dict:
        """TRL's evaluation loss and loss metrics of `batch` (one micro-batch, no update); on
        the device, like step's."""
        group = self.prompt_group(batch, batch.size)
        return self.programs.eval(state, self.shard_batch(self.packed(batch, 1, group, False)),
                                  self.frozen, group)

    def mix_ref(self, params, ref, alpha: float):
        """TR-DPO's reference update alpha * params + (1 - alpha) * ref, on the devices with the
        params' shardings; `ref`'s buffers are donated (use the returned tree)."""
        return self.programs.mix(params, ref, np.float32(alpha), np.float32(1.0 - alpha))

    def logps(self, params, batch: Batch, rows: int | None = None) -> np.ndarray:
        """Completion log-probs without gradients: old (num_iterations > 1) or reference
        (ADAPTERS_OFF: the base model's), on the host. `rows`: computed that many rows at a
        time (a micro-batch's worth, so the program's memory is bounded by the update's, not
        the generation batch's) when they divide the batch; else all at once. With the
        sampler's routing record the forwards replay it under routing replay."""
        return self.logps_and_mismatch(params, batch, rows)[0]

    def logps_and_mismatch(self, params, batch: Batch, rows: int | None = None
                           ) -> tuple[np.ndarray, float | None]:
        """logps, and router/mismatch over the batch's completion tokens (the fraction of
        token-layers whose experts differ from the sampler's record; None without a record:
        a dense model, or another sampler)."""
        seqs = batch.replace(old_logp=None, ref_logp=None, sampler_logp=None)
        if params is ADAPTERS_OFF:
            params = self.adapters_off
        n = seqs.size
        step = rows if rows and n % rows == 0 else n
        # Every part is dispatched before the first is read back.
        group = self.prompt_group(seqs, step)
        parts = [self.programs.logps(self.graphdef, params, self.shard_batch(self.packed(
            seqs.rows(slice(i, i + step)), 1, group, False)), self.frozen, group)
            for i in range(0, n, step)]
        logp = np.concatenate([np.asarray(p[0]) for p in parts])
        if parts[0][1] is None:
            return logp, None
        differ, counted = np.sum([np.asarray(p[1], np.float64) for p in parts], axis=0)
        return logp, float(differ / counted) if counted else 0.0

    def rollout_params(self, params):
        """The full model's params for a sampler or server: `params` themselves, or with LoRA
        the base with the adapters merged in (one fused program, once per round)."""
        return params if self.lora_scale is None else self._merge(self.frozen[0], params)


def prompt_blocks(batch: Batch) -> int:
    """The largest block size, dividing the batch's rows, whose aligned blocks of consecutive
    rows each hold one prompt (ids and mask; with images, their pixels, grids and M-RoPE
    positions too: two prompts of the same text may show different images): a round's
    num_generations completions of a prompt in a row make it num_generations (or a multiple,
    where neighbours share a prompt)."""
    P = batch.prompt_ids.shape[1]
    parts = [np.asarray(x) for x in (batch.prompt_ids, batch.prompt_mask, batch.pixel_values,
                                     batch.image_grid, None if batch.positions is None
                                     else np.asarray(batch.positions)[:, :, :P]) if x is not None]
    n = parts[0].shape[0]
    for s in range(n, 1, -1):
        if n % s == 0 and all((x.reshape(-1, s, *x.shape[1:]) == x[::s, None]).all()
                              for x in parts):
            return s
    return 1


def mix_params(params, ref, alpha, keep):
    """ref * keep + params * alpha leaf by leaf, rounded as TRL's SyncRefModelCallback in the
    reference's dtype: `ref.mul_(keep).add_(params, alpha=alpha)` (keep = 1 - alpha, computed in
    double on the host as Python does; both rounded to float32, torch's math type)."""
    def one(p, r):
        kept = (r.astype(jnp.float32) * keep).astype(r.dtype)
        return (kept.astype(jnp.float32) + alpha * p.astype(jnp.float32)).astype(r.dtype)
    return jax.tree.map(one, params, ref)
