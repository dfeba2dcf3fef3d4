"""Native JAX generation: one compiled program per (batch, prompt-length) bucket.

Prompts are left-padded to the smallest length bucket that fits and the batch is padded to a
power of two, so a run compiles a bounded number of programs. The weights are an argument of the
program (never a closed-over constant), so loading new weights never recompiles.

The program is a prefill over the prompt that writes the KV cache ([L, B, K, P + C, Dh] per run
of layers the prefill and decode steps scan, models.KVCache; a sliding-window layer's holds its
window) and samples
the first token, then one `lax.while_loop` that feeds the last token, samples the next, and stops
as soon as every row has emitted a stop token or C = max_completion_length tokens exist.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_jax import distributed as dist
from grpo_jax import images
from grpo_jax import mesh as mesh_lib
from grpo_jax.models import Decoder, KVCache, ModelConfig, build, lora, moe, positions_from_mask
from grpo_jax.models import qwen_vl
from grpo_jax.rollout import row_images
from grpo_jax.rollout.base import RolloutBatch
from grpo_jax.rollout.native import sampling
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.rollout.padding import left_pad
from grpo_jax.shapes import DEFAULT_BUCKETS, next_pow2

class DecodeState(NamedTuple):
    step: jax.Array          # [] int32: tokens sampled so far
    rows: jax.Array          # [B] int32: the round's row each batch row is: its sampling keys
    tokens: jax.Array        # [B, C] int32
    mask: jax.Array          # [B, C] int32
    logp: jax.Array          # [B, C] fp32
    done: jax.Array          # [B] bool
    cache: KVCache
    seen: jax.Array | None   # [B, V] bool, only with a repetition penalty
    # [B, C, S, k] the experts each completion token ran in each of the S sparse layers, as
    # fed to the decoder (moe.routing_dtype; -1: never fed); only when recording routing.
    routing: jax.Array | None = None


class DecodeContext(NamedTuple):
    """What every decode step reads, prepared once by the prefill."""
    params: Any              # the weights in the compute dtype (norm scales as they are)
    layers: list             # Decoder.decode_layers() of those: cut into runs once, outside a loop
    key_mask: jax.Array      # [B, P + C] int32: which cache slots hold real keys
    # [B] int32: real prompt tokens per row, plus the row's M-RoPE delta with images (the
    # decode positions are prompt_len + completion index).
    prompt_len: jax.Array
    # [B, P, S, k] the experts each prompt token ran (its prefill), when recording routing.
    prompt_routing: jax.Array | None = None


class ImageInputs(NamedTuple):
    """A prompt pass's images (Sampler.image_inputs), traced: B prompts, n images."""
    pixel_values: jax.Array  # Gemma 3 [n, C, H, W]; Qwen-VL [n, P, C*T*P*P] (padded to P)
    grid: jax.Array | None  # Qwen-VL [n, 3] int32 each image's (t, h, w)
    positions: jax.Array  # [B, width], or Qwen-VL's M-RoPE [3, B, width]
    deltas: jax.Array  # [B] decode position deltas (M-RoPE's; 0 otherwise)
    is_image: jax.Array  # [B, width] bool: the placeholders to fill
    first: jax.Array | None  # [B] each prompt's first image (blocks), or None: HF's order


class Sampler:
    """Compiled KV-cache sampler for one model architecture and one set of sampling params.

    `mesh`: optional ('data', 'fsdp', ['context',] 'tensor') mesh; the batch is split over data
    x fsdp, the cache's KV heads over tensor and its slots over context, and the params are
    placed by `grpo_jax.mesh`'s rule table (a no-op when they already are, as the trainer's are).

    `peft`: a LoRA run's PeftArgs (models/lora.py) when the sampler runs the adapters on the
    frozen base itself instead of a merged copy: its params are then the pair
    (adapters, base) of `nnx.split(model, LoraParam, nnx.Param)`, the base possibly quantized.

    `record_routing` (a mixture of experts): also return each prompt and completion token's
    top-k experts per sparse layer (RolloutBatch.prompt_routing, completion_routing), for
    routing replay and the router/mismatch metric (models/moe.py).

    Refilled decode slots (refill.py) and KV-cache continuation (continuation.py) build their
    programs from this one's parts: `inputs`, `prompt_pass`, `prefill`, `decode_step`, `emit`,
    `decoder`, `constrain`.
    """

    def __init__(self, model_cfg: ModelConfig, sampling_params: SamplingParams, *, pad_id: int,
                 mesh: Mesh | None = None, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 cache_dtype: Any = None, peft=None, record_routing: bool = False):
        if not 0 <= pad_id < model_cfg.vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, "
                             f"{model_cfg.vocab_size}); pass the tokenizer's pad_token_id")
        bad_stop = [t for t in sampling_params.stop_token_ids
                    if not 0 <= t < model_cfg.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, "
                             f"{model_cfg.vocab_size})")
        if not buckets or any(int(b) < 1 for b in buckets):
            raise ValueError(f"buckets={tuple(buckets)} must be positive prompt lengths")
        if record_routing and not model_cfg.num_experts:
            raise ValueError("record_routing needs a mixture of experts: a dense model has no "
                             "router")
        self.record_routing = record_routing
        if model_cfg.numerics.replay:
            # Routing replay runs the trainer's forwards dropless (models/moe.py): the sampler
            # too, so that every expert it records is an expert it ran.
            model_cfg = model_cfg.replace(moe_capacity_factor=None)
        self.cfg, self.sampling_params = model_cfg, sampling_params
        self.pad_id, self.mesh = pad_id, mesh
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.cache_dtype = model_cfg.dtype if cache_dtype is None else cache_dtype
        # No activation constraint here (Decoder.shard_activations): in the sampler's program
        # XLA lays rows out by the KV cache's sharding, and the constraint made Qwen2.5-7B's
        # generate temporaries on v5e-16 grow from 2.84 to 13.40 GB.
        self.peft = peft
        abstract = build.abstract_model(model_cfg, peft)
        abstract.expert_mesh = mesh  # a sparse layer's experts on the mesh's expert axis
        self.graphdef, abstract_params = _split(abstract, peft)
        self._param_shapes = _shapes(abstract_params)
        # (params, prompt ids, mask, key, first row; num_generations, rows) -> tokens, mask,
        # log-probs, done (and with record_routing the prompts' and completions' experts): what
        # generate runs, and what aot compiles for a target.
        self.program = jax.jit(self._generate,
                               static_argnames=("num_generations", "rows"))

    # ------------------------------------------------------------------ host side

    def generate(self, params, prompt_token_ids: Sequence[Sequence[int]],
                 num_generations: int = 1, rng: int | jax.Array = 0,
                 first_row: int = 0, pixel_values=None, image_grid_thw=None,
                 image_tokens=None, images_per_prompt: int | None = None) -> RolloutBatch:
        """Sample `num_generations` completions per prompt.

        params: the model's nnx.State of nnx.Param (`nnx.split(model, nnx.Param)[1]`) or the
        Decoder itself. rng: an int seed or a jax PRNG key; the same rng gives the same output.
        Row i's token t is drawn with the key fold_in(fold_in(rng, t), first_row + i), whatever
        else is in the batch: a round generated in parts (first_row: where this part starts) or
        through refilled slots (rollout/native/refill.py) draws what one batch does.
        pixel_values, image_grid_thw: the prompts' images in prompt order, as the model's HF
        processor gives them (a vision-language model, each prompt holding its images'
        placeholders; Decoder.embed_multimodal): Qwen-VL [n, P, C*T*P*P] (each image's
        patches padded to P: image_blocks) or the processor's [N, C*T*P*P], with its grids
        [n, 3]; Gemma 3 [N, C, H, W] and no grid. One program per P (the grids are arrays);
        one host (not split over a mesh). image_tokens: per prompt, how many of its first
        tokens may hold image placeholders (None: all), or a bool per real token; the rest is text
        whatever its ids, as the trainer embeds a completion (a multi-turn context: prompt +
        completion so far, whose tool results' images are placeholders: rollout.tools).
        images_per_prompt: the images come in blocks of that many per prompt, a prompt's own
        then blank ones (image_blocks), which no placeholder takes; None: HF's order.
        """
        params, prompts, g, n, rows = self.inputs(params, prompt_token_ids, num_generations)
        # The program prefills each prompt once and copies its cache to its g rows: prompts
        # enough to cover `rows`, the ones past the real prompts all padding.
        ids, mask = left_pad(prompts, 1, self.bucket(max(map(len, prompts))), self.pad_id,
                             rows=self.prompt_rows(rows, g))
        key = as_key(rng)
        args = (ids, mask)
        images = self.image_inputs(ids, mask, pixel_values, image_grid_thw, image_tokens,
                                   images_per_prompt)
        if self.mesh is not None:
            # With several processes each places only its own devices' rows, and gets every
            # row back (the train batch is built on every host alike).
            args = tuple(dist.shard_host_array(x, mesh_lib.logical_sharding(
                self.mesh, "batch", None, shape=x.shape)) for x in args)
            params = jax.device_put(params, mesh_lib.param_shardings(params, self.mesh))
        tokens, cmask, logp, done, *routing = dist.to_host(self.program(
            params, *args, key, np.int32(first_row), images, num_generations=g, rows=rows))
        ids, mask = np.repeat(ids, g, axis=0)[:n], np.repeat(mask, g, axis=0)[:n]
        # The prefill samples each row's first token, the loop one more per step until the
        # longest row is done.
        decoded = np.maximum(cmask.sum(axis=1) - 1, 0)
        prompt_routing, completion_routing = (r[:n] for r in routing) if routing else (None, None)
        return RolloutBatch(ids, mask, tokens[:n], cmask[:n], ~done[:n], logp[:n],
                            metrics=decode_metrics(int(decoded.max()), int(decoded.sum()), rows),
                            prompt_routing=prompt_routing, completion_routing=completion_routing)

    def image_inputs(self, ids, mask, pixel_values, image_grid_thw, image_tokens=None,
                     images_per_prompt: int | None = None) -> ImageInputs | None:
        """The program's ImageInputs for padded prompts (see generate); None without images.
        Qwen-VL's pixel_values come padded per image ([n, P, values]: image_blocks) or as the
        processor's [N, values]."""
        if pixel_values is None:
            return None
        first = (None if images_per_prompt is None else
                 jnp.arange(len(ids), dtype=jnp.int32) * images_per_prompt)
        is_image, text = self.placeholders(ids, mask, image_tokens)
        if self.cfg.mrope_section is not None:  # Qwen-VL
            grid = np.asarray(image_grid_thw, np.int32).reshape(-1, 3)
            # Blocks: each prompt's own grids (its blanks none); else the batch's in order.
            rows = grid if images_per_prompt is None else grid.reshape(-1, images_per_prompt, 3)
            positions, deltas = qwen_vl.rope_index(self.cfg.vision, text, mask, rows)
            pixels = jnp.asarray(pixel_values)
            if pixels.ndim == 2:  # the processor's order
                pixels = qwen_vl.pad_patches(pixels, grid)
            return ImageInputs(pixels, jnp.asarray(grid), positions, deltas,
                               jnp.asarray(is_image), first)
        # one position row, decode positions as for text
        return ImageInputs(jnp.asarray(pixel_values), None, positions_from_mask(jnp.asarray(mask)),
                           jnp.zeros(len(ids), jnp.int32), jnp.asarray(is_image), first)

    def placeholders(self, ids, mask, image_tokens=None):
        """images.placeholders with this model's placeholder id."""
        return images.placeholders(ids, mask, self.cfg.vision.image_token_id, self.pad_id,
                                   image_tokens)

    def row_positions(self, prompt_ids, prompt_mask, image_grid, completion_width: int,
                      image_tokens=None, completion_images=None):
        """row_images.positions of this model's rows (None without M-RoPE)."""
        return row_images.positions(self.cfg, self.pad_id, prompt_ids, prompt_mask,
                                    image_grid, completion_width, image_tokens,
                                    completion_images)

    def inputs(self, params, prompt_token_ids, num_generations):
        """(params, prompts, g, n, rows) of a generate call, checked: n = prompts x g rows
        sampled, padded to `rows`."""
        params = self.check_params(params)
        prompts = self.check_prompts(prompt_token_ids)
        g = int(num_generations)
        if g < 1:
            raise ValueError(f"num_generations={num_generations} must be >= 1")
        n = len(prompts) * g
        return params, prompts, g, n, self.batch_size(n)

    def check_params(self, params):
        if isinstance(params, nnx.Module):
            params = _split(params, self.peft)[1]
        if _shapes(params) != self._param_shapes:
            want = ("(adapters, base) = nnx.split(model, LoraParam, nnx.Param)[1:] of a LoRA model"
                    " with the same PeftArgs" if self.peft else "nnx.split(model, nnx.Param)[1]")
            raise ValueError(f"params do not match the sampler's model config; pass {want} "
                             "(or the Decoder) of a model built from the same ModelConfig")
        return params

    def check_prompts(self, prompt_token_ids) -> list[np.ndarray]:
        if isinstance(prompt_token_ids, (str, bytes)) or not len(prompt_token_ids):
            raise ValueError("prompt_token_ids must be a non-empty list of token-id lists")
        prompts = []
        for i, p in enumerate(prompt_token_ids):
            if isinstance(p, (str, bytes)) or np.ndim(p) != 1:
                raise ValueError(f"prompt {i} is not a list of token ids; tokenize it first")
            a = np.asarray(p, np.int64)
            if a.size == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if a.min() < 0 or a.max() >= self.cfg.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
            prompts.append(a.astype(np.int32))
        return prompts

    def bucket(self, length: int) -> int:
        """The prompt width the program is compiled for: the smallest bucket >= `length`."""
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(f"a prompt of {length} tokens exceeds the largest bucket "
                         f"{self.buckets[-1]}; pass buckets=(..., {next_pow2(length)}) or shorten "
                         "prompts (max_prompt_length)")

    def prompt_rows(self, rows: int, num_generations: int) -> int:
        """Prompts the prefill runs on for `rows` sampled rows: enough to cover them, rounded
        up to the batch axes' size so they shard like the rows (when they divide)."""
        div = 1 if self.mesh is None else mesh_lib.batch_divisor(self.mesh)
        prompts = -(-rows // num_generations)
        return -(-prompts // div) * div

    def batch_size(self, n: int) -> int:
        """The rows the program runs for `n` sampled rows: a power of two, rounded up to the
        batch axes' size."""
        div = 1 if self.mesh is None else mesh_lib.batch_divisor(self.mesh)
        return -(-next_pow2(n) // div) * div

    # ------------------------------------------------------------------ compiled program

    def decoder(self, params) -> Decoder:
        return nnx.merge(self.graphdef, *(params if self.peft else (params,)))

    def constrain(self, x, *names):
        """x laid out by logical axis names (see grpo_jax.mesh.RULES)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(
            x, mesh_lib.logical_sharding(self.mesh, *names, shape=x.shape))

    def constrain_cache(self, cache: KVCache) -> KVCache:
        return jax.tree.map(lambda x: self.constrain(x, *KVCache.AXES), cache)

    def _generate(self, params, prompt_ids, prompt_mask, key, first_row=0, images=None, *,
                  num_generations: int, rows: int):
        ctx, state = self.prefill(params, prompt_ids, prompt_mask, key, num_generations, rows,
                                   first_row, images)
        C = self.sampling_params.max_completion_length
        state = jax.lax.while_loop(lambda s: (s.step < C) & ~jnp.all(s.done),
                                   lambda s: self.decode_step(ctx, s, key), state)
        out = state.tokens, state.mask, state.logp, state.done
        if state.routing is None:
            return out
        return (*out, ctx.prompt_routing, state.routing)

    def prompt_pass(self, params, prompt_ids, prompt_mask, record_routing: bool = False,
                    images: ImageInputs | None = None):
        """The prompts' pass: (params in the compute dtype, their decode_layers(), the prompts'
        KV cache [L, prompts, K, width, Dh] per run (a sliding layer's: its window at most), the
        last logits [prompts, V]); record_routing: and, fifth, the experts each prompt token
        ran [prompts, width, S, k] (moe.routing_dtype; -1 on padding). images: the prompts'
        (ImageInputs)."""
        cfg = self.cfg
        cast = cast_matrices(params, cfg.dtype)
        model = self.decoder(cast)
        layers = model.decode_layers()
        cache = self.constrain_cache(KVCache.zeros(cfg, *prompt_ids.shape, self.cache_dtype))
        positions, embeds = positions_from_mask(prompt_mask), None
        if images is not None:
            positions = images.positions
            embeds = model.embed_multimodal(prompt_ids, images.pixel_values, images.grid,
                                            is_image=images.is_image, first_image=images.first)
        hidden, cache, *chosen = model.prefill(
            prompt_ids, positions, prompt_mask, cache, layers,
            chunk=self.sampling_params.prefill_chunk_size, record_routing=record_routing,
            inputs_embeds=embeds)
        logits = model.logits(hidden)[:, 0]  # left padding: the last slot is real
        if not record_routing:
            return cast, layers, cache, logits
        real = prompt_mask.astype(bool)[:, :, None, None]
        return cast, layers, cache, logits, jnp.where(real, chosen[0], -1).astype(
            moe.routing_dtype(cfg.num_experts))

    def prefill(self, params, prompt_ids, prompt_mask, key, num_generations: int,
                 rows: int, first_row=0,
                 images: ImageInputs | None = None) -> tuple[DecodeContext, DecodeState]:
        """The prompts' pass that fills the KV cache, and the first token of each of `rows`
        rows (prompt i's num_generations rows are consecutive). Each prompt is run once and its
        keys, values and last logits are copied to its rows: the prefill costs 1/G of running
        every row. Separate from the decode step so that `grpo_jax.aot` can cost the two apart
        (XLA's cost analysis counts a while loop's body once)."""
        sp, cfg = self.sampling_params, self.cfg
        width = prompt_ids.shape[1]
        C = sp.max_completion_length
        prompt_ids = self.constrain(prompt_ids, "batch", None)
        prompt_mask = self.constrain(prompt_mask, "batch", None)
        cast, layers, cache, logits, *prompt_routing = self.prompt_pass(
            params, prompt_ids, prompt_mask, self.record_routing, images)
        # Decode positions: the real prompt tokens, plus M-RoPE's delta (qwen_vl.rope_index).
        prompt_len = jnp.sum(prompt_mask, axis=1) + (0 if images is None else images.deltas)

        def to_rows(x):  # [prompts, ...] -> [rows, ...]: each prompt's G copies in a block
            x = jnp.repeat(x, num_generations, axis=0)[:rows]
            return self.constrain(x, "batch", *[None] * (x.ndim - 1))
        prompt_ids, prompt_mask, logits, prompt_len = map(
            to_rows, (prompt_ids, prompt_mask, logits, prompt_len))
        prompt_routing = [to_rows(r) for r in prompt_routing]
        # The generated tokens' slots follow the prompt's (a sliding-window layer's ring
        # grows to its window at most).
        cache = jax.tree.map(lambda x: jnp.repeat(x, num_generations, axis=1)[:, :rows], cache)
        cache = self.constrain_cache(cache.grown(cfg, width + C))
        batch, row_axes = rows, ("batch", None)
        # Generated slots are all valid keys; the causal mask hides the ones not yet written.
        key_mask = jnp.concatenate([prompt_mask, jnp.ones((batch, C), jnp.int32)], axis=1)
        ctx = DecodeContext(cast, layers, key_mask, prompt_len, *prompt_routing)
        seen = None
        if sp.repetition_penalty != 1.0:
            seen = jnp.zeros((batch, cfg.vocab_size), bool)
            seen = seen.at[jnp.arange(batch)[:, None], prompt_ids].max(prompt_mask.astype(bool))
        state = DecodeState(
            step=jnp.zeros((), jnp.int32),
            rows=first_row + jnp.arange(batch, dtype=jnp.int32),
            tokens=self.constrain(jnp.full((batch, C), self.pad_id, jnp.int32), *row_axes),
            mask=self.constrain(jnp.zeros((batch, C), jnp.int32), *row_axes),
            logp=self.constrain(jnp.zeros((batch, C), jnp.float32), *row_axes),
            done=~jnp.any(prompt_mask.astype(bool), axis=1),  # batch-padding rows
            cache=cache, seen=seen)
        if self.record_routing:
            shape = (batch, C, sum(cfg.moe_layers), cfg.num_experts_per_tok)
            state = state._replace(routing=self.constrain(
                jnp.full(shape, -1, moe.routing_dtype(cfg.num_experts)), *row_axes, None, None))
        return ctx, self.emit(state, logits, key)

    def decode_step(self, ctx: DecodeContext, s: DecodeState, key) -> DecodeState:
        """Feed the last token, sample the next."""
        model = self.decoder(ctx.params)
        width = ctx.key_mask.shape[1] - self.sampling_params.max_completion_length
        last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        hidden, cache, *chosen = model(
            last, (ctx.prompt_len + s.step - 1)[:, None], ctx.key_mask, cache=s.cache,
            cache_index=width + s.step - 1, layers=ctx.layers,
            record_routing=s.routing is not None)
        s = s._replace(cache=self.constrain_cache(cache))
        if chosen:  # the experts of the token just fed, completion token step - 1
            s = s._replace(routing=jax.lax.dynamic_update_slice_in_dim(
                s.routing, chosen[0].astype(s.routing.dtype), s.step - 1, axis=1))
        return self.emit(s, model.logits(hidden)[:, 0], key)

    def emit(self, s: DecodeState, logits, key) -> DecodeState:
        """Sample the token at completion index `s.step` for every row not yet done."""
        sp = self.sampling_params
        batch = logits.shape[0]
        token, logp = sampling.sample(row_keys(key, s.step, s.rows), logits, sp, s.seen)
        live = ~s.done
        token = jnp.where(live, token, self.pad_id)
        logp = jnp.where(live, logp, 0.0)
        put = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, col[:, None].astype(buf.dtype), s.step, axis=1)
        done = s.done
        if sp.stop_token_ids:
            done = done | (live & jnp.isin(token, jnp.asarray(sp.stop_token_ids)))
        seen = s.seen
        if seen is not None:
            seen = seen.at[jnp.arange(batch), token].max(live)
        return s._replace(step=s.step + 1, tokens=put(s.tokens, token),
                          mask=put(s.mask, live), logp=put(s.logp, logp), done=done, seen=seen)


def row_keys(key, step, rows) -> jax.Array:
    """[B] sampling keys: row rows[b]'s token step (step: [] or [B]), from the round's key
    alone, so a row draws the same tokens whichever batch or slot it runs in."""
    step = jnp.broadcast_to(step, rows.shape)
    return jax.vmap(lambda t, r: jax.random.fold_in(jax.random.fold_in(key, t), r))(step, rows)


def decode_metrics(steps: int, tokens: int, slots: int) -> dict:
    """A generate call's counts for the round's metrics: its decode steps (each one pass over
    every slot, the prefill not counted) and the mean fraction of slots that decoded a live row
    in them (`tokens`: the tokens they sampled)."""
    return {"generate/decode_steps": float(steps), "generate/slot_steps": float(steps * slots),
            "generate/slot_occupancy": tokens / (steps * slots) if steps else 0.0}


def merge_decode_metrics(parts: Sequence[dict | None]) -> dict | None:
    """decode_metrics of several generate calls (sub-batches, tool turns) as of one."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    steps, slot_steps = (sum(p[f"generate/{k}"] for p in parts) for k in ("decode_steps",
                                                                          "slot_steps"))
    live = sum(p["generate/slot_occupancy"] * p["generate/slot_steps"] for p in parts)
    return {"generate/decode_steps": steps, "generate/slot_steps": slot_steps,
            "generate/slot_occupancy": live / slot_steps if slot_steps else 0.0}


def as_key(rng) -> jax.Array:
    """A typed PRNG key from an int seed, a typed key or a raw uint32 jax.random.PRNGKey."""
    key = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else rng
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return key


def cast_matrices(params, dtype, copy: bool = False):
    """Cast weights to the compute dtype once, before the loop, instead of on every decode step
    (the decoder casts them the same way; norm scales stay as they are, it reads them in fp32).
    `copy`: every leaf in new buffers, also where nothing is cast (eager, outside jit)."""
    def cast(path, x):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        # Norm scales, a quantized base's codes and their scales stay as they are.
        if (str(names[-1]).endswith(("norm", "_qscale")) or x.dtype == dtype
                or not jnp.issubdtype(x.dtype, jnp.floating)):
            return x.copy() if copy else x
        return x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def reference_copy(params, dtype):
    """The reference model's params: a copy of `params` with matrices in the compute `dtype`
    (half the memory of fp32 masters in a bf16 run; TRL's reference model is in the model's
    dtype too). The forward casts matrices to that dtype anyway, so its log-probs are the same
    as from `params`."""
    return cast_matrices(params, dtype, copy=True)


def _split(model: Decoder, peft):
    """(graphdef, params): params the state of nnx.Param, or with `peft` the pair (adapters,
    base)."""
    if not peft:
        return nnx.split(model, nnx.Param)
    graphdef, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)
    return graphdef, (adapters, base)


def _shapes(tree) -> list:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), tuple(getattr(x, "shape", ()))) for path, x in leaves]
