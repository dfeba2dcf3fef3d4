"""The run's three device programs, lowered with abstract arguments laid out as a run lays them.

- `update`: grpo.train_step.train_step on one window (gradient_accumulation_steps
  micro-batches), jitted as policy.Policy jits it (state donated, shardings from mesh.RULES);
- `logprobs`: policy.Policy's reference / old log-prob program on a micro-batch;
- `generate`: the run's JaxRollout's sampler program on a generation batch (prefill + decode
  loop);
- `refill`: with `max_num_seqs` decode slots fewer than those rows, rollout.native.refill.Refill's
  program, which a run then runs instead: the rows through the slots, whose KV cache is
  slots x (prompt + completion) rather than rows x. Lowered with `generate` (phase
  "generate"), which stays for the forecast: a static batch of every row.

Nothing is allocated: parameters, optimizer state and batches are jax.ShapeDtypeStructs that
carry NamedShardings over the target's devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import mesh as mesh_lib
from grpo_jax import run_facts
from grpo_jax.config import BatchPlan, TrainConfig
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.train_step import StepConfig
from grpo_jax.models import KVCache, ModelConfig, lora
from grpo_jax.models.build import abstract_model
from grpo_jax.rollout.native.rollout import JaxRollout
from grpo_jax.rollout.native.sampler import ImageInputs
from grpo_jax.policy import build_programs, split_policy, step_config


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One configuration on one mesh: what its programs are lowered from (train.Run is the
    run itself, built from data)."""
    cfg: TrainConfig
    model: ModelConfig
    mesh: Any
    plan: BatchPlan
    # A vision-language model: merged image tokens in each prompt (all its images'; their
    # placeholders count in max_prompt_length). 0: text-only programs.
    image_tokens: int = 0
    # --images-per-prompt: the images they make, of equal size (a batch's blocks of K images,
    # image_blocks); None: the tower's count (Qwen2.5-VL one, Gemma 3 one per
    # mm_tokens_per_image).
    images: int | None = None

    @property
    def step_config(self) -> StepConfig:
        return step_config(self.cfg, self.plan, self.model)

    @property
    def tower_shape(self):
        """What the vision tower makes of a prompt's images (TowerShape)."""
        return self.model.vision.encoded(self.image_tokens, self.images)

    def with_layers(self, n: int) -> "Lowering":
        return dataclasses.replace(self, model=self.model.with_layers(n))


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def shard_bytes(tree) -> int:
    """Bytes per device of abstract arrays with shardings (the largest shard)."""
    return sum(_bits(x.dtype) * _prod(x.sharding.shard_shape(x.shape)) // 8
               for x in jax.tree.leaves(tree))


def _bits(dtype) -> int:
    """Bits per element as stored on the chip: 4 for NF4 codes (numpy's itemsize says 1 byte)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return 8 * dtype.itemsize


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@dataclasses.dataclass
class Programs:
    """Lowered programs and the abstract state they run on."""
    lowered: dict[str, Any]  # phase -> jax.stages.Lowered
    state: Any  # abstract TrainState
    frozen: tuple  # with LoRA, (the frozen base,) as Policy.frozen; else ()
    kv_cache: Any  # abstract KVCache of the sampler, as laid out inside its program
    sampler_rows: int
    prompt_width: int
    sampler_takes_adapters: bool  # reads (adapters, base), not a merged copy of the model
    decode_slots: int | None = None  # with a `refill` program: its slots


PHASES = ("generate", "logprobs", "update")


def build(run: Lowering, phases: tuple[str, ...] = PHASES) -> Programs:
    """The run's programs, lowered: those of `phases` (none: only the abstract state)."""
    mesh, step_cfg = run.mesh, run.step_config
    replicated = NamedSharding(mesh, P())
    # With LoRA the model is what peft_io.load_model builds: the base in the compute dtype
    # (quantized with load_in_8bit / 4bit), the adapters in the param dtype.
    peft = run.cfg.peft if run.cfg.peft.use_peft else None
    split = split_policy(abstract_model(run.model, peft, run.cfg.numerics.param_dtype), mesh)
    graphdef, frozen = split.graphdef, tuple(
        _abstract(base, mesh_lib.param_shardings(base, mesh)) for base in split.frozen)
    # The trainer's own programs, built from abstract params (no data: the steps max_steps
    # says, else run_facts.UNLOADED_TOTAL_STEPS; only the schedule's constants depend on it).
    programs = build_programs(graphdef, split.params, step_cfg, run.cfg.optim,
                              run_facts.total_steps(run.cfg.batch, run.plan), mesh)
    params = _abstract(split.params, programs.param_shardings)
    state = _abstract(jax.eval_shape(programs.init, params), programs.state_shardings)
    g, group = run.cfg.grpo.num_generations, run_facts.planned_prompt_group(run.cfg, run.plan)
    k = run.plan.gradient_accumulation_steps

    # The run's own rollout: its sampler, its decode slots, how it reads the policy's weights.
    rollout = JaxRollout(run.model, run.cfg.generation, pad_id=0, mesh=mesh, peft=peft)
    sampler = rollout.sampler
    form = run_facts.sampler_weights(rollout.weight_mode, peft is not None)
    takes_adapters = form == run_facts.ADAPTERS_AND_BASE
    if takes_adapters:
        weights = (state.params, frozen[0])
    elif form == run_facts.MERGED:  # GRPORound hands the sampler a merged copy of the base
        merged = jax.eval_shape(lambda b, a: lora.merge_into_base(b, a, split.lora_scale),
                                frozen[0], state.params)
        weights = _abstract(merged, mesh_lib.param_shardings(merged, mesh))
    else:
        weights = state.params
    rows = sampler.batch_size(run.plan.generation_batch_size)
    width = sampler.bucket(run.cfg.data.max_prompt_length)
    ids = _rows((sampler.prompt_rows(rows, g), width), jnp.int32, mesh)  # each prompt once
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=replicated)
    images = _sampler_images(run, ids.shape[0], width)
    first_row = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    gen_args = (weights, ids, ids, key, first_row, images)
    C, sp = run.cfg.generation.max_completion_length, run.cfg.generation
    # The refill program, where the round's rows outnumber max_num_seqs (else one batch, or
    # sub-batches of the sampler's own program without continuous_batching).
    refill = (rollout.slots if rollout.slots is not None and sp.continuous_batching
              and rows > sp.max_num_seqs else None)
    cached = rows if refill is None else refill.slots
    cache = jax.eval_shape(lambda: KVCache.zeros(run.model, cached, width + C,
                                                 sampler.cache_dtype))
    cache_sh = jax.tree.map(lambda x: mesh_lib.logical_sharding(
        mesh, *KVCache.AXES, shape=x.shape), cache)
    lower = {
        "generate": lambda: sampler.program.lower(*gen_args, num_generations=g, rows=rows),
        # A micro-batch at a time, as Policy.logps runs it.
        "logprobs": lambda: programs.logps.lower(
            graphdef, state.params, _batch(run, run.plan.micro_batch_size, width, logps=False),
            frozen, group),
        "update": lambda: programs.step.lower(
            state, _batch(run, run.plan.micro_batch_size * k, width), frozen, group, k),
    }
    lowered = {k: lower[k]() for k in phases}
    if refill is not None and "generate" in phases:
        rows_in_round = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        lowered["refill"] = refill.program.lower(*gen_args[:4], rows_in_round, images,
                                                 num_generations=g, rows=rows)
    return Programs(lowered, state, frozen, _abstract(cache, cache_sh), rows, width,
                    takes_adapters, refill and refill.slots)


def _rows(shape, dtype, mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.batch_sharding(mesh, len(shape)))


def image_grid(run: Lowering) -> tuple | None:
    """A row's images' patch grids as the Batch and the sampler carry them (Qwen2.5-VL's K
    images of one size; None for Gemma 3's fixed-size images, or text)."""
    if not run.image_tokens or run.model.mrope_section is None:
        return None
    k = run.tower_shape.images
    return run.model.vision.image_grid(run.image_tokens // k) * k


def _sampler_images(run: Lowering, prompts: int, width: int) -> ImageInputs | None:
    """The sampler's ImageInputs for the prompt pass, as Sampler.generate hands them:
    pixel_values of every prompt's images (float32, as the processor gives them; one host's,
    replicated: Qwen2.5-VL [prompts x images, patches, values] with their grids, Gemma 3
    [prompts x images, C, H, W]), positions (M-RoPE's [3, prompts, width]; Gemma 3's [prompts,
    width]) and the decode position deltas [prompts] and the placeholders to fill [prompts,
    width]. None without images."""
    if not run.image_tokens:
        return None
    replicated = NamedSharding(run.mesh, P())
    shape = run.tower_shape
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                    sharding=replicated)
    grid = image_grid(run)
    n = prompts * shape.images
    if grid is None:  # Gemma 3: positions as for text
        return ImageInputs(arg((n, *shape.pixels), jnp.float32), None,
                           arg((prompts, width), jnp.int32), arg((prompts,), jnp.int32),
                           arg((prompts, width), jnp.bool_), None)
    return ImageInputs(arg((n, *shape.pixels), jnp.float32), arg((n, 3), jnp.int32),
                       arg((3, prompts, width), jnp.int32), arg((prompts,), jnp.int32),
                       arg((prompts, width), jnp.bool_), None)


def _batch(run: Lowering, n: int, width: int, logps: bool = True) -> Batch:
    """The abstract Batch a round feeds the program: what GRPORound fills in for this config
    (with images: each row's pixel_values, its M-RoPE positions and its images' grids)."""
    C, mesh = run.cfg.generation.max_completion_length, run.mesh
    tokens = lambda: _rows((n, C), jnp.int32, mesh)  # noqa: E731
    per_token = lambda: _rows((n, C), jnp.float32, mesh)  # noqa: E731
    batch = Batch(_rows((n, width), jnp.int32, mesh), _rows((n, width), jnp.int32, mesh),
                  tokens(), tokens(), _rows((n,), jnp.bool_, mesh), _rows((n,), jnp.float32, mesh))
    if run.image_tokens:  # images.PromptPixels' rows
        shape, grid = run.tower_shape, image_grid(run)
        batch = batch.replace(
            pixel_values=_rows((n, shape.images, *shape.pixels), jnp.float32, mesh),
            positions=_rows((n, 3, width + C), jnp.int32, mesh) if grid else None,
            image_grid=_rows((n, shape.images, 3), jnp.int32, mesh) if grid else None)
    if not logps:
        return batch
    return batch.replace(sampler_logp=per_token(), num_items=_rows((n,), jnp.float32, mesh),
                         ref_logp=per_token() if run_facts.has_reference(run.cfg) else None,
                         old_logp=per_token() if run.plan.needs_old_logps else None)
