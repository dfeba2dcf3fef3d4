"""One decoder-only transformer for the Llama, Mistral, Phi-3, Qwen2/3 and Gemma 2/3 families and
the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss (Flax NNX): the families differ by
switches in ModelConfig, read in `_block` (the experts: models/moe.py).

Layers are stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not
grow with depth (the sampler's passes over a KV cache too, unless numerics.sampler_layers unrolls
them). A model whose dense and sparse layers mix (Qwen3-MoE's mlp_only_layers) stacks the dense
MLPs over its dense layers and the experts over its sparse ones, and scans each run of same-kind
layers in turn. Every parameter carries logical axis names in its `axes` metadata;
`mesh.py` maps them to mesh axes with one rule table.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import mesh as mesh_lib
from grpo_jax.models import attention as attention_lib
from grpo_jax.models import decode_attention as decode_attention_lib
from grpo_jax.models import lora, moe
from grpo_jax.models.attention import Mask
from grpo_jax.models.config import (ImageTower, ModelConfig, param_table,  # noqa: F401 (API)
                                    runs_of)
from grpo_jax.models.moe import RouterStats

DENSE_MLP = ("w_gate", "w_up", "w_down")


def stack_of(cfg: ModelConfig, key: str) -> bool | None:
    """Which layers a stacked per-layer array (a `layer_params` key: weight, adapter, scale)
    runs over: None every layer, True the sparse ones, False the dense ones (config's
    stack_layers)."""
    base = key.split("_lora_")[0].removesuffix("_qscale")
    if base in moe.EXPERT_LEAVES:
        return True
    if base in DENSE_MLP and cfg.num_experts:
        return False
    return None


def layer_runs(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """(first, stop, sparse) of each run of consecutive same-kind layers (alike in their MLP,
    and in whether DeepStack features are added after them)."""
    deep = [i < cfg.deepstack_layers for i in range(cfg.num_layers)]
    return [(first, stop, cfg.moe_layers[first])
            for first, stop in runs_of(list(zip(cfg.moe_layers, deep)))]


def _run_params(cfg: ModelConfig, stacked: dict, first: int, stop: int) -> dict:
    """The stacked per-layer arrays of layers [first, stop) (one kind: dense or sparse), cut
    out of `layer_params()` (sliced only where the run is not the whole stack)."""
    sparse = cfg.moe_layers[first]
    before = sum(s == sparse for s in cfg.moe_layers[:first])
    own = {None: (first, stop), sparse: (before, before + stop - first)}
    return {k: v if own[stack_of(cfg, k)] == (0, v.shape[0]) else
            v[own[stack_of(cfg, k)][0]:own[stack_of(cfg, k)][1]]
            for k, v in stacked.items() if stack_of(cfg, k) in own}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _init_values(shapes, dtype, norm_offset: bool, keys) -> list[jax.Array]:
    """Every weight's random value in one program: drawn one by one, each shape was a program of
    its own to compile (a tiny model's ~10 of them took seconds on a CPU)."""
    return [_init_value(name, shape, dtype, key, norm_offset)
            for (name, shape), key in zip(shapes, keys)]


def _init_value(name: str, shape, dtype, key, norm_offset: bool):
    leaf = name.split("/")[-1]
    if "layernorm" in leaf:  # a LayerNorm's (SigLIP's): scale 1, shift 0, whatever norm_offset
        return (jnp.zeros if leaf.endswith("bias") else jnp.ones)(shape, dtype)
    if leaf.endswith("norm"):  # a scale of 1 (Gemma stores it as 1 + w)
        return (jnp.zeros if norm_offset else jnp.ones)(shape, dtype)
    if leaf.startswith("b"):
        return jnp.zeros(shape, dtype)
    # The barrier keeps the scaling out of the draw's fusion: the values stay those the draws
    # had when each ran as a program of its own (fused, they moved in the last bit).
    z = jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))
    return (0.02 * z).astype(dtype)


def scatter_images(x, is_image, features, starts=None):
    """x [B, T, D] with the image placeholders (is_image [B, T]) replaced, in row-major order,
    by features [n, D] (n = placeholders), as HF's masked_scatter. starts [B]: row b's
    placeholders take features from starts[b] on instead (rows whose images come in blocks
    padded with blank images, which no placeholder takes)."""
    if starts is None:
        index = jnp.cumsum(is_image.reshape(-1)) - 1
    else:
        index = (starts[:, None] + jnp.cumsum(is_image, axis=1) - 1).reshape(-1)
    index = jnp.clip(index, 0, features.shape[0] - 1)
    picked = features.astype(x.dtype)[index].reshape(x.shape)
    return jnp.where(is_image[..., None], picked, x)


class KVCache(NamedTuple):
    """One key and one value buffer per run of layers (ModelConfig.cache_runs), each
    [L, B, K, S, Dh] in the compute dtype (L: the run's layers; 1 where the sampler unrolls).

    A layer writes its new keys into the run's buffer and then reads its slice of the written
    buffer: a read of the old value after the write would make XLA copy the whole buffer every
    decode step. KV heads come before slots so that attention's batch dims (b, k) lead, as a
    batched matmul wants them; slot-major buffers were transposed (copied) twice per layer per
    step.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    # Each buffer's logical axes (mesh.RULES): rows over the batch axes, KV heads over tensor,
    # slots over the context axis (a row's cache split by position).
    AXES = (None, "batch", "kv_heads", "length", None)

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
        """For `length` positions; a sliding-window layer's buffer holds only its window."""
        dtype = cfg.dtype if dtype is None else dtype
        shapes = [(stop - first, batch, cfg.num_kv_heads, cfg.cache_length(first, length),
                   cfg.head_dim) for first, stop in cfg.cache_runs()]
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for shape in shapes)  # noqa: E731
        return cls(zeros(), zeros())

    def grown(self, cfg: ModelConfig, length: int) -> "KVCache":
        """The same keys and values in buffers for `length` positions: empty slots appended
        (a sliding layer's ring up to its window)."""
        def grow(first, x):
            extra = cfg.cache_length(first, length) - x.shape[3]
            return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra), (0, 0)))
        firsts = [first for first, _ in cfg.cache_runs()]
        return KVCache(*(tuple(map(grow, firsts, part)) for part in self))


class _Layers(nnx.Module):
    """Holder for the stacked per-layer parameters."""


class Decoder(nnx.Module):
    # The mesh the activations are laid out on (set by `shard_activations`; static, part of the
    # graphdef). None: no constraint, as on one device.
    mesh = None
    # The mesh whose `expert` axis a sparse layer's experts are split over (models/moe.py; None:
    # no expert parallelism). Set by `shard_activations`, and by the sampler, which leaves its
    # rows unconstrained.
    expert_mesh = None
    # LoRA (models/lora.py, which alone sets them): the adapters' scale (PEFT's lora_alpha / r;
    # None: no adapters), the dropout rate on their inputs, and, inside a traced train step
    # only, the key its masks are drawn from (None: no dropout, as PEFT in eval mode).
    lora_scale: float | None = None
    lora_dropout: float = 0.0
    lora_dropout_key: jax.Array | None = None

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        """Random weights; `hf.load_model` builds the decoder abstractly (`nnx.eval_shape`) and
        loads its weights straight onto their shardings instead."""
        self.cfg = cfg
        self.layers = _Layers()
        # A vision-language model's image tower (an ImageTower), else None: a holder whose
        # parameters the table below sets (vision/...).
        self.vision: ImageTower | None = None if cfg.vision is None else cfg.vision.tower()
        table = param_table(cfg)
        keys = [rngs.params() for _ in table]
        values = _init_values(tuple((n, tuple(s)) for n, (s, _) in table.items()),
                              cfg.param_dtype, cfg.norm_offset, keys)
        for (name, (_, axes)), value in zip(table.items(), values):
            *path, leaf = name.split("/")
            owner = self
            for part in path:  # layers/..., vision/blocks/...: the holder the table names
                owner = getattr(owner, part)
            setattr(owner, leaf, nnx.Param(value, axes=axes))

    def head_weight(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def layer_params(self) -> dict[str, jax.Array]:
        """The stacked per-layer weights, by table name without the 'layers/' prefix, and the
        LoRA adapters and quantized weights' scales when the model has them (models/lora.py)."""
        return {**{name[7:]: getattr(self.layers, name[7:])[...]
                   for name in param_table(self.cfg) if name.startswith("layers/")},
                **lora.layer_extras(self)}

    def logits(self, hidden: jax.Array) -> jax.Array:
        w = self.head_weight().astype(self.cfg.dtype)
        logits = jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)
        return softcap(logits, self.cfg.final_logit_softcapping)

    def shard_activations(self, mesh) -> None:
        """Lay the hidden states [B, T, D] out with their rows on the batch axes (mesh.RULES)
        at every layer. Without it XLA's propagation may keep the FSDP-sharded weights where
        they are and replicate the activations instead, all-reducing whole [B, T, F] matmul
        outputs: on Qwen2.5-7B over v5e-16 that was 9 GB of an update's temporaries."""
        self.mesh = self.expert_mesh = mesh

    def shard_rows(self, x):
        """x [B, ...] with its rows on the batch axes (identity without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, mesh_lib.logical_sharding(
            self.mesh, "batch", *[None] * (x.ndim - 1), shape=x.shape))

    def shard_tokens(self, x):
        """x [B, T, ...] (hidden states) with its rows on the batch axes and its positions on
        the context axis (mesh.RULES' `length`; identity without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, mesh_lib.logical_sharding(
            self.mesh, "batch", "length", *[None] * (x.ndim - 2), shape=x.shape))

    def sequence_order(self, length: int):
        """The order in which `length` positions go through the decoder under context
        parallelism (attention.zigzag_order over the mesh's context axis), so that each device
        does the same causal work; None: sequence order (no context axis, or a length that
        does not split)."""
        return attention_lib.zigzag_order(length, mesh_lib.context_size(self.mesh))

    def head_layout(self, h, w):
        """One log-prob chunk's hidden states [B, c, D] and head [D, V] on the mesh: vocabulary-
        parallel, every device taking all the chunk's rows (a few MB) and its slice of the
        vocabulary (over every mesh axis), so that the head's gradient comes out split. With
        the rows split instead, every device holds a partial gradient of the whole head to
        reduce (Qwen2.5-7B on v5e-16: 2.2 GB of fp32; update temporaries 10.06 -> 8.81 GB).
        Rows split when the vocabulary does not divide over the devices."""
        if self.mesh is None:
            return h, w
        if w.shape[1] % self.mesh.size:
            return self.shard_rows(h), w
        everywhere = NamedSharding(self.mesh, P())
        return (jax.lax.with_sharding_constraint(h, everywhere),
                jax.lax.with_sharding_constraint(w, NamedSharding(
                    self.mesh, P(None, tuple(self.mesh.axis_names)))))

    def embed_tokens(self, tokens) -> jax.Array:
        x = self.embed[...].astype(self.cfg.dtype)[tokens]
        if self.cfg.scale_embeddings:  # Gemma; the scale rounded to the dtype, as in HF
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, self.cfg.dtype)
        return x

    def embed_text(self, tokens) -> jax.Array:
        """The tokens' embeddings as wide as embed_multimodal's, so that either serves where
        the other may (a DeepStack model's [B, T, D * (1 + K)]: zero addends)."""
        x = self.embed_tokens(tokens)
        k = self.cfg.deepstack_layers
        return x if not k else jnp.pad(x, ((0, 0), (0, 0), (0, k * x.shape[-1])))

    def split_deepstack(self, x):
        """Input embeddings [B, T, D] or a DeepStack model's [B, T, D * (1 + K)] ->
        (embeddings [B, T, D], the addends [K, B, T, D] or None): layer i < K adds its slice
        after it (zero but at image positions, as transformers adds the features there)."""
        d = self.cfg.hidden_size
        if x.shape[-1] == d:
            return x, None
        deep = x[..., d:].reshape(*x.shape[:-1], -1, d)
        return x[..., :d], jnp.moveaxis(deep, -2, 0)

    def embed_multimodal(self, tokens, pixel_values, image_grid_thw=None,
                         frozen_tower: bool = False, is_image=None,
                         first_image=None, skip=None) -> jax.Array:
        """The input embeddings [B, T, D] of a prompt with images, for `__call__`/`prefill`'s
        inputs_embeds (a DeepStack model's [B, T, D * (1 + K)]: embed_text): the tokens'
        embeddings, the k-th image placeholder of the batch
        (image_token_id, row by row) taking the k-th of the tower's features, as HF's
        masked_scatter. pixel_values and image_grid_thw: Qwen-VL [n, P, C*T*P*P] (each
        image's patches as the HF processor gives them, padded to P: image_blocks) or the
        processor's [N, C*T*P*P] (the grids then read on the host), with its grids [n, 3] (an
        array: any grids of at most P patches share a program); Gemma 3 [N, C, H, W], no grid.
        The features are not scaled by sqrt(hidden) (HF scatters them after Gemma's scaled
        embedding). frozen_tower: no gradient flows into
        the tower (a training forward whose tower is not trained: no backward through it).
        is_image [B, T] bool: the placeholders to fill (default: every image_token_id; a
        multi-turn context's completion holds text whatever its ids, but where a tool result's
        images are: rollout.tools). first_image [B] int:
        the index of row b's first image in pixel_values, its placeholders taking that image's
        features on (in blocks per row padded with blank images: image_blocks); None: HF's
        order, the k-th placeholder of the batch the k-th feature.
        skip [B] int (with first_image): row b's placeholders take features from skip[b] past
        its first image's on (a completion's tool-result images after its prompt's)."""
        if is_image is None:
            is_image = tokens == self.cfg.vision.image_token_id
        # The placeholder's own embedding is replaced (Gemma's id is out of its vocabulary).
        x = self.embed_text(jnp.where(is_image, 0, tokens))
        features, counts = self.vision(pixel_values, image_grid_thw, self.cfg.dtype)
        if frozen_tower:
            features = jax.lax.stop_gradient(features)
        n, per = features.shape[:2]
        features = features.reshape(n * per, -1)
        if counts is None:  # every image the same number of features, all its own
            counts = jnp.full((n,), per, jnp.int32)
        else:  # each image's own features together, in order: the padding after them all
            own = jnp.arange(per)[None] < counts[:, None]
            features = features[jnp.argsort(~own.reshape(-1), stable=True)]
        starts = None
        if first_image is not None:
            starts = (jnp.cumsum(counts) - counts)[first_image]
            if skip is not None:
                starts = starts + skip
        return scatter_images(x, is_image, features, starts)

    def decode_layers(self) -> list[dict[str, jax.Array]]:
        """The weights of each run of cache_runs(), stacked [L, ...], for `__call__(...,
        layers=)`. A decode loop calls this once, outside the loop, so no step slices a run out
        of the stacked arrays (the sampler also casts them to the compute dtype first, so no
        step casts either). q/k/v and gate/up need no manual fusion: XLA's dot merger already
        runs each group as one matmul."""
        stacked = self.layer_params()
        return [_run_params(self.cfg, stacked, first, stop)
                for first, stop in self.cfg.cache_runs()]

    def scan_layers(self, body, carry, routing=None, deep=None):
        """lax.scan of body(carry, (layer params, slides, forced, added)) -> (carry,
        (RouterStats or None, experts or None)) over the layers, one scan per run of same-kind
        layers (a dense run's params have no experts, a sparse run's no dense MLP), under the
        config's remat. `routing`: a pytree of [S, ...] replayed experts per sparse layer (S of
        them), a sparse layer's slice its `forced` (None in dense layers, and without replay).
        `deep`: a pytree of [K, ...] DeepStack addends (split_deepstack), layer i < K's slice
        its `added` (None in the other layers, and without one). Returns (carry, RouterStats
        summed over the sparse layers or None for a dense model, the experts the body returned
        stacked [S, ...] over the sparse layers, or None)."""
        cfg = self.cfg
        if cfg.remat:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat_policy])
        stacked, sliding = self.layer_params(), jnp.asarray(cfg.sliding_layers)
        stats = RouterStats.zeros(cfg.num_experts) if cfg.num_experts else None
        chosen = []
        for first, stop, sparse in layer_runs(cfg):
            xs = _run_params(cfg, stacked, first, stop)
            forced = None
            if sparse and routing is not None:
                before = sum(cfg.moe_layers[:first])
                forced = jax.tree.map(lambda a: a[before:before + stop - first], routing)
            added = (None if deep is None or first >= cfg.deepstack_layers
                     else jax.tree.map(lambda a: a[first:stop], deep))
            carry, (run_stats, idx) = jax.lax.scan(body, carry,
                                                   (xs, sliding[first:stop], forced, added))
            if run_stats is not None:
                stats = stats.plus(jax.tree.map(lambda a: a.sum(0), run_stats))
            if idx is not None:
                chosen.append(idx)
        if not chosen:
            return carry, stats, None
        return carry, stats, jax.tree.map(lambda *a: jnp.concatenate(a), *chosen)

    def __call__(self, tokens, positions, attention_mask, cache: KVCache | None = None,
                 cache_index=None, layers: list[dict] | None = None, order=None,
                 with_router: bool = False, routing=None, record_routing: bool = False,
                 inputs_embeds: jax.Array | None = None):
        """Run the decoder and return (hidden [B, T, D] after the final norm, new cache).

        tokens, positions: [B, T] int. Without a cache, attention_mask is [B, T] (1 = real token),
        attention is causal over the T tokens and the layers run under `lax.scan`. With a cache
        of S slots, attention_mask is [B, S] (which slots hold real tokens), the T new tokens are
        written at slots [cache_index, cache_index + T) and attend to every real slot up to
        their own; each run of cache_runs() goes under a `lax.scan` of its own (a run of one
        layer: unrolled). cache_index may also be [B] (one token per row, T = 1, each row at
        its own slot: decode slots refilled as rows finish). `layers`: `decode_layers()`,
        prepared once outside a decode loop (default: computed here).
        `order` (without a cache): a permutation of the T positions (`sequence_order(T)`); the
        tokens then go through the layers, and come back as hidden states, in that order
        (attention still sees the sequence in its own order). with_router (no cache): also
        return the RouterStats of the real tokens (None for a dense model), for the
        load-balancing loss.
        Routing replay (models/moe.py), for a mixture of experts: `routing` [B, T, S, k] (no
        cache; S sparse layers, -1: not recorded) the experts each token runs in each sparse
        layer; record_routing: also return the experts each token ran, [B, T, S, k] int32, as
        the last item ((hidden, cache, experts), or with with_router (hidden, None, stats,
        experts)).
        inputs_embeds [B, T, D]: the input embeddings in place of the tokens' (a
        vision-language model's: embed_multimodal); tokens still give the shapes and say where
        the images are (Gemma 3's image blocks attend both ways without a cache and in a
        prefill). M-RoPE (cfg.mrope_section): positions may be [3, B, T]
        (qwen_vl.rope_index); [B, T] serves text, whose three rows are equal.
        """
        cfg = self.cfg
        if routing is not None and cache is not None:
            raise ValueError("replayed routing is for the forward without a cache (training)")
        blocks = image_blocks(tokens, cfg.vision.image_token_id) if cfg.image_blocks else None
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds.astype(cfg.dtype)
        if order is not None:
            tokens, positions, x = tokens[:, order], positions[..., order], x[:, order]
            routing = None if routing is None else routing[:, order]
        x, deep = self.split_deepstack(x)
        x = self.shard_tokens(x)
        sliding = cfg.sliding_layers
        # (cos, sin) per attention kind; sliding layers may have their own RoPE base (Gemma 3).
        rope = {False: rope_tables(cfg, positions)}
        rope[True] = rope_tables(cfg, positions, local=True) if any(sliding) else rope[False]
        B, T = tokens.shape
        key_ok = attention_mask.astype(bool)
        if cache is None:
            mesh = self.mesh
            token_ok = key_ok if order is None else key_ok[:, order]  # x's tokens' order

            def body(x, xs):
                p, slides, forced, added = xs
                cos, sin = _pick(sliding, slides, rope)
                mask = Mask(np.arange(T) if order is None else order, key_ok,
                            _window(cfg, slides), blocks)
                x, _, _, stats, idx = _block(cfg, p, self.shard_tokens(x), cos, sin, mask,
                                             mesh=mesh, key_order=order,
                                             expert_mesh=self.expert_mesh, token_mask=token_ok,
                                             forced=forced)
                if added is not None:
                    x = x + added
                return self.shard_tokens(x), (stats, idx if record_routing else None)

            x, stats, chosen = self.scan_layers(
                body, x, None if routing is None else jnp.moveaxis(routing, 2, 0), deep)
            out = (self._final_norm(x), None) + ((stats,) if with_router else ())
            if record_routing:
                out += (_unorder(per_token(chosen), order),)
            return out

        S = attention_mask.shape[1]  # positions; a sliding layer's buffer may hold fewer
        if isinstance(cache_index, int) and cache_index == 0:
            # A prefill into an empty cache: the tokens attend among themselves only, as
            # without a cache (and with the same kernel), instead of over all S slots.
            cache_index = None
            masks = {s: Mask(np.arange(T), key_ok[:, :T], cfg.sliding_window if s else None,
                             blocks) for s in (False, True)}
        elif T > 1 and not any(sliding):
            # A chunk of a long prompt (chunked prefill): query t at position cache_index + t
            # sees the real positions up to its own, by blocks (attention.flash).
            masks = {False: Mask(cache_index + jnp.arange(T), key_ok)}
        else:
            # Query t sits at position cache_index + t and sees the real positions up to its own.
            # cache_index [B]: each row writes and reads at its own slot (_write_rows).
            query = jnp.asarray(cache_index)[..., None] + jnp.arange(T)  # [T] or [B, T]
            masks = {False: (query[..., None] >= jnp.arange(S)) & key_ok[:, None]}
            if any(sliding):
                masks[True] = _ring_mask(query, key_ok, cfg.cache_length(sliding.index(True), S),
                                         cfg.sliding_window)
        ks, vs, chosen = [], [], []
        runs = zip(cfg.cache_runs(), self.decode_layers() if layers is None else layers, *cache)
        for (first, stop), params, kbuf, vbuf in runs:
            slides = sliding[first]
            cos, sin = rope[slides]
            added = None if deep is None or first >= cfg.deepstack_layers else deep[first:stop]

            def body(carry, xs, slides=slides, cos=cos, sin=sin):
                x, kbuf, vbuf = carry
                p, layer, add = xs
                x, kbuf, vbuf, _, idx = _block(
                    cfg, p, self.shard_rows(x), cos, sin, masks[slides],
                    (kbuf, vbuf, layer, cache_index), window=cfg.sliding_window if slides else None,
                    expert_mesh=self.expert_mesh, decode_mesh=self.mesh)
                if add is not None:
                    x = x + add
                return (x, kbuf, vbuf), idx if record_routing else None

            if stop - first == 1:  # unrolled: the layer's buffer is the run's, at a static 0
                (x, kbuf, vbuf), idx = body((x, kbuf, vbuf), (
                    jax.tree.map(lambda a: a[0], params), 0,
                    None if added is None else added[0]))
                idx = None if idx is None else idx[None]
            else:
                (x, kbuf, vbuf), idx = jax.lax.scan(body, (x, kbuf, vbuf),
                                                    (params, jnp.arange(stop - first), added))
            ks.append(kbuf)
            vs.append(vbuf)
            if idx is not None:  # a sparse run's [L, B, T, k]
                chosen.append(idx)
        out = (self._final_norm(x), KVCache(tuple(ks), tuple(vs)))
        if record_routing:
            out += (per_token(jnp.concatenate(chosen) if chosen else None),)
        return out

    def prefill(self, tokens, positions, attention_mask, cache: KVCache, layers=None,
                chunk: int | None = None, record_routing: bool = False,
                inputs_embeds: jax.Array | None = None):
        """Fill an empty cache with T prompt tokens (left-padded; attention_mask [B, T] over
        the cache's first T slots): returns (hidden [B, 1, D] of the last token, cache).
        `chunk`: T tokens at a time (chunked prefill, under lax.scan), each chunk attending
        over the slots written so far by blocks (attention.flash), so a long prompt holds one
        chunk's activations, not T's. Unchunked where T does not split into chunks, and with
        sliding-window layers (a chunk written into a ring would overwrite keys its own
        earlier queries still see). record_routing: also the experts each prompt token ran,
        [B, T, S, k] int32 (see __call__), as a third item. `inputs_embeds`: see __call__
        (unchunked: an image's block attends both ways, across chunks)."""
        T = tokens.shape[1]
        if (not chunk or T <= chunk or T % chunk or any(self.cfg.sliding_layers)
                or inputs_embeds is not None):
            hidden, cache, *chosen = self(tokens, positions, attention_mask, cache=cache,
                                          cache_index=0, layers=layers,
                                          record_routing=record_routing,
                                          inputs_embeds=inputs_embeds)
            return (hidden[:, -1:], cache, *chosen)
        layers = self.decode_layers() if layers is None else layers
        split = lambda a: a.reshape(a.shape[0], T // chunk, chunk).swapaxes(0, 1)  # noqa: E731

        def step(cache, xs):
            i, t, p = xs
            hidden, cache, *chosen = self(t, p, attention_mask, cache=cache,
                                          cache_index=i * chunk, layers=layers,
                                          record_routing=record_routing)
            return cache, (hidden[:, -1], *chosen)
        cache, (last, *chosen) = jax.lax.scan(step, cache, (jnp.arange(T // chunk),
                                                            split(tokens), split(positions)))
        # [chunks, B, chunk, S, k] -> [B, T, S, k]
        chosen = [None if c is None else jnp.moveaxis(c, 0, 1).reshape(c.shape[1], T, *c.shape[3:])
                  for c in chosen]
        return (last[-1][:, None], cache, *chosen)

    def shared_prefix(self, prompt_ids, prompt_mask, ids, mask, group: int,
                      orders=(None, None), with_router: bool = False, routing=None,
                      record_routing: bool = False, prompt_embeds=None, positions=None,
                      completion_embeds=None, packing=None):
        """The forward of `group` completions per prompt with each prompt computed once (Prefix
        Grouper, arXiv 2506.05433): returns (hidden [g, P, D] of the prompts, hidden [g * group,
        C, D] of the completions), equal to running every row's prompt + completion through
        `__call__` (left-padded prompt_ids / prompt_mask [g, P]; ids / mask [g * group, C],
        row r continuing prompt r // group). The completions attend to their prompt's keys and
        values, copied to the group's rows, so the gradients reaching the prompt positions are
        summed over the group. Training FLOPs go from N (P + C) to g P + N C token-passes.
        `orders`: (prompt order, completion order), permutations of P and C positions
        (`sequence_order`) in which the two parts run and come back, as `__call__`'s order.
        with_router: also the RouterStats of every row's real tokens (a prompt's counted once
        per row, as running the rows one by one counts them). `routing`: replayed experts, the
        pair (prompts' [g, P, S, k], completions' [g * group, C, S, k]) (see __call__);
        record_routing: also the pair of experts the prompts and completions ran, last.
        A vision-language model's prompts: `prompt_embeds` [g, P, D] (embed_multimodal: the
        tower runs once per prompt, not once per row) and, for M-RoPE, `positions` the pair
        ([3, g, P], [3, g * group, C]); Gemma 3's image blocks attend both ways in the prompt.
        `completion_embeds` [g * group, C, D]: the completions' (a tool result's images in
        them: embed_multimodal), else the tokens'.
        `packing` (padding-free, grpo/packing.py): the pair ([M, K] the prompts each row holds,
        -1 an unused slot; [M, C] each token's segment, its unpacked row, -1 on padding): ids /
        mask are M packed rows, completions end to end, each attending to its own prompt's
        keys (its row's slot of prompt segment // group) and its own segment's; `positions`
        then gives the completions' (each segment's own); `group` still the rows per prompt
        (router statistics count a prompt once per unpacked row)."""
        cfg, mesh = self.cfg, self.mesh
        P_len, C = prompt_ids.shape[1], ids.shape[1]
        prompt_ok, ok = prompt_mask.astype(bool), mask.astype(bool)
        segments = None
        if packing is None:
            rep = lambda a: self.shard_rows(jnp.repeat(a, group, axis=0))  # noqa: E731
            rep_ok = rep(prompt_ok)
        else:  # a packed row's K prompt slots end to end: [M, K * P] keys
            slots, seg = packing
            rep = lambda a: self.shard_rows(jnp.take(a, jnp.maximum(slots, 0), axis=0).reshape(
                slots.shape[0], -1, *a.shape[2:]))
            rep_ok = rep(prompt_ok) & jnp.repeat(slots >= 0, P_len, axis=1)
            # A prompt's keys carry the id -2 - its group, a completion's its segment; a query
            # sees its segment's and its group's (padding: the row's first prompt's).
            tag = lambda g: -2 - jnp.maximum(g, 0)  # noqa: E731
            segments = (seg, tag(jnp.where(seg >= 0, seg // group, slots[:, :1])),
                        jnp.concatenate([jnp.repeat(tag(slots), P_len, axis=1), seg], axis=1))
        if positions is None:
            positions = (positions_from_mask(prompt_mask),
                         jnp.maximum(rep(prompt_mask.sum(1))[:, None] + jnp.cumsum(mask, axis=1)
                                     - 1, 0))
        positions = dict(zip(("prompt", "completion"), positions))
        # Numbered over whole rows, as __call__ numbers them (the prompt's blocks come first).
        blocks = None
        if cfg.image_blocks:
            rows = image_blocks(jnp.concatenate([rep(prompt_ids), ids], axis=1),
                                cfg.vision.image_token_id)
            blocks = {"prompt": rows[::group, :P_len], "completion": rows}
        o_p, o_c = orders
        x0 = {"prompt": (self.embed_tokens(prompt_ids) if prompt_embeds is None
                         else prompt_embeds.astype(cfg.dtype)),
              "completion": (self.embed_tokens(ids) if completion_embeds is None
                             else completion_embeds.astype(cfg.dtype))}
        forced = None if routing is None else dict(zip(("prompt", "completion"), routing))
        for part, o in (("prompt", o_p), ("completion", o_c)):
            if o is not None:
                x0[part], positions[part] = x0[part][:, o], positions[part][..., o]
                if forced is not None:
                    forced[part] = forced[part][:, o]
        deep = {}
        for part in x0:
            x0[part], deep[part] = self.split_deepstack(x0[part])
        deep = None if all(d is None for d in deep.values()) else deep
        sliding = cfg.sliding_layers
        rope = {}  # part -> sliding -> (cos, sin)
        for part in positions:
            full = rope_tables(cfg, positions[part])
            rope[part] = {False: full, True: rope_tables(cfg, positions[part], local=True)
                          if any(sliding) else full}
        # Completion query t is key P + t; it sees its prompt's real keys and its own up to t.
        # (Packed: after the row's K prompts' keys.)
        queries = {"prompt": np.arange(P_len) if o_p is None else o_p,
                   "completion": rep_ok.shape[1] + (np.arange(C) if o_c is None else o_c)}
        keys_ok = {"prompt": prompt_ok, "completion": jnp.concatenate([rep_ok, ok], 1)}
        # The real tokens among the hidden states, in the order they run (router statistics).
        tokens_ok = {"prompt": prompt_ok if o_p is None else prompt_ok[:, o_p],
                     "completion": ok if o_c is None else ok[:, o_c]}

        def body(carry, xs):
            x_prompt, x = carry
            p, slides, f, added = xs
            f = {"prompt": None, "completion": None} if f is None else f
            window = _window(cfg, slides)
            q, k, v = _qkv(cfg, p, x_prompt, *_pick(sliding, slides, rope["prompt"]))
            k, v = (attention_lib.gather_keys(a, o_p, mesh) for a in (k, v))
            attn = _attend(cfg, q, k, v, Mask(queries["prompt"], keys_ok["prompt"], window,
                                              None if blocks is None else blocks["prompt"]),
                           mesh, sinks=_sinks(cfg, p))
            x_prompt, prompt_stats, prompt_idx = _attn_out_and_mlp(
                cfg, p, x_prompt, attn, tokens_ok["prompt"], self.expert_mesh, f["prompt"])
            q, kc, vc = _qkv(cfg, p, x, *_pick(sliding, slides, rope["completion"]))
            k = jnp.concatenate([rep(k), attention_lib.gather_keys(kc, o_c, mesh)], axis=1)
            v = jnp.concatenate([rep(v), attention_lib.gather_keys(vc, o_c, mesh)], axis=1)
            attn = _attend(cfg, q, k, v, Mask(queries["completion"], keys_ok["completion"],
                                              window,
                                              None if blocks is None else blocks["completion"],
                                              segments),
                           mesh, sinks=_sinks(cfg, p))
            x, stats, idx = _attn_out_and_mlp(cfg, p, x, attn, tokens_ok["completion"],
                                              self.expert_mesh, f["completion"])
            if stats is not None:
                stats = stats.plus(prompt_stats, weight=group)
            if added is not None:  # DeepStack: the prompt's images (a tool result's)
                x_prompt = x_prompt if added["prompt"] is None else x_prompt + added["prompt"]
                x = x if added["completion"] is None else x + added["completion"]
            chosen = (prompt_idx, idx) if record_routing and idx is not None else None
            return (self.shard_tokens(x_prompt), self.shard_tokens(x)), (stats, chosen)

        x0 = tuple(self.shard_tokens(x0[part]) for part in ("prompt", "completion"))
        routing = None if forced is None else {k: jnp.moveaxis(v, 2, 0) for k, v in forced.items()}
        (x_prompt, x), stats, chosen = self.scan_layers(body, x0, routing, deep)
        out = (self._final_norm(x_prompt), self._final_norm(x)) + ((stats,) if with_router else ())
        if record_routing:
            out += ((None, None) if chosen is None else tuple(
                _unorder(per_token(c), o) for c, o in zip(chosen, orders)),)
        return out

    def _final_norm(self, x):
        cfg = self.cfg
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.dtype, cfg.norm_offset)


# What the backward pass keeps of each layer's forward: "full" keeps only the layer input and
# recomputes the rest; "dots" also keeps the outputs of weight matmuls (more memory, no matmul
# recomputed: about 6 instead of 8 matmul FLOPs per parameter and token).
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _pick(sliding: tuple[bool, ...], slides, by_kind: dict):
    """by_kind[True] for a sliding layer, else by_kind[False]; static when all layers agree,
    else chosen inside the layer scan by its traced `slides` flag."""
    if all(sliding) or not any(sliding):
        return by_kind[all(sliding)]
    return jax.tree.map(lambda u, v: jnp.where(slides, u, v), by_kind[True], by_kind[False])


def _window(cfg: ModelConfig, slides):
    """The attention window of a layer (attention.Mask's): None for full attention; a sliding
    layer sees keys fewer than sliding_window positions behind (transformers'
    sliding_window_overlay: kv_idx > q_idx - window; left padding shifts a row's tokens but
    not their distances, so indices in the padded sequence serve). Static when all layers
    agree, else chosen inside the layer scan by the traced `slides` flag."""
    sliding = cfg.sliding_layers
    if not any(sliding):
        return None
    if all(sliding):
        return cfg.sliding_window
    return jnp.where(slides, cfg.sliding_window, 2 ** 30)


def _ring_mask(query, key_ok, slots: int, window: int) -> jax.Array:
    """[B, T, slots] for a sliding layer's ring buffer (slot = position % window): slot s
    holds the newest position p <= q with p % window == s; it is seen when p >= 0 and real
    (key_ok [B, S] by position). Within the window by construction."""
    s = jnp.arange(slots)
    held = query[..., None] - (query[..., None] - s) % window  # [T, slots] or [B, T, slots]
    where = jnp.clip(held, 0, key_ok.shape[1] - 1)
    if held.ndim == 3:  # per-row queries (_write_rows)
        return jnp.take_along_axis(key_ok[:, None, :], where, axis=2) & (held >= 0)
    real = jnp.take(key_ok, where, axis=1)  # [B, T, slots]
    return real & (held >= 0)[None]


softcap = attention_lib.softcap


def image_blocks(tokens, image_token_id: int) -> jax.Array:
    """[B, T] int32: each run of image tokens numbered from 0 in its row, -1 elsewhere
    (transformers' get_block_sequence_ids_for_mask over token_type_ids = the image tokens)."""
    is_image = tokens == image_token_id
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions for a left-padded batch: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def rms_norm(x, weight, eps, dtype, offset: bool = False):
    """offset: Gemma's norm, which scales by (1 + weight), in fp32 before the cast."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (weight.astype(jnp.float32) + (1.0 if offset else 0.0))).astype(dtype)


def rope_tables(cfg: ModelConfig, positions, local: bool = False):
    """(cos, sin) [B, T, Dh] of positions [B, T] (or M-RoPE's [3, B, T]). local: for a
    sliding layer, which has its own unscaled base when the config gives one (Gemma 3), else
    the same RoPE as the others."""
    d = cfg.head_dim
    own = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if own else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    # Gemma 3 scales only the full-attention layers' RoPE, never a sliding layer's own base.
    if not own and cfg.rope_llama3:
        inv_freq = _llama3_scale(inv_freq, *cfg.rope_llama3)
    elif not own and cfg.rope_linear:
        inv_freq = inv_freq / cfg.rope_linear
    elif not own and cfg.rope_yarn:
        inv_freq = _yarn_inv_freq(d, theta, *cfg.rope_yarn[:5])
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    if cfg.mrope_section and positions.ndim == 3:
        # M-RoPE: frequency j turns with the position row (t, h, w) whose section holds it.
        row = np.repeat(np.arange(len(cfg.mrope_section)), cfg.mrope_section)
        if cfg.mrope_interleaved:  # t, h, w, t, h, w, ... while h's and w's sections last
            j = np.arange(d // 2)
            row = np.where((j % 3 > 0) & (j < 3 * np.asarray(cfg.mrope_section)[j % 3]),
                           j % 3, 0)
        freqs = jnp.moveaxis(freqs, 0, -1)[..., np.arange(d // 2), row]  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = cfg.rope_yarn[5] if cfg.rope_yarn and not own else 1.0
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def _yarn_inv_freq(d, base, factor, beta_fast, beta_slow, original_max_pos, truncate):
    """transformers' YaRN frequencies: interpolated (divided by factor) below the correction
    range, extrapolated (unchanged) above it, a linear ramp between."""
    import math

    def correction_dim(rotations):
        return d * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_scale(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_pos):
    low_wavelen = original_max_pos / low_freq_factor
    high_wavelen = original_max_pos / high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def _rope(x, cos, sin):
    # HF's "rotate half" convention: the two halves of head_dim are the rotation pairs.
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def _block(cfg: ModelConfig, p, x, cos, sin, mask, cache=None, window: int | None = None,
           mesh=None, key_order=None, expert_mesh=None, token_mask=None, forced=None,
           decode_mesh=None):
    """One layer. With cache = (kbuf, vbuf, layer, index) the new keys and values are written
    into layer `layer` of the run's buffers [L, B, K, S, Dh] at slot `index` and the queries
    attend over that layer's cache (mask [B, T, S], or an attention.Mask over the S slots);
    index None writes at slot 0 and attends among the new tokens only, as without a cache (an
    attention.Mask over the T tokens). `window`: the layer slides and its cache is a ring
    (slot = position % window). `mesh`, `key_order`: see _attend. `expert_mesh`: where a sparse
    layer's experts live; `token_mask` [B, T]: the real tokens its router statistics count;
    `forced` [B, T, k]: its replayed experts (models/moe.py). `decode_mesh`: the mesh the
    decode-attention kernel is laid out on (numerics.decode_attention "pallas").
    Returns (x, kbuf, vbuf, RouterStats, experts [B, T, k]) (the buffers None without a cache;
    the stats None for a dense layer or without token_mask; the experts None for a dense
    layer)."""
    q, k, v = _qkv(cfg, p, x, cos, sin)
    kbuf = vbuf = None
    if cache is not None:
        kbuf, vbuf, layer, index = cache
        kbuf, vbuf = (_write(kbuf, layer, k, index, window),
                      _write(vbuf, layer, v, index, window))
        ck, cv = kbuf[layer], vbuf[layer]  # read after the write: no copy of the buffer
    sinks = _sinks(cfg, p)
    if cache is not None and index is not None:
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        cap = cfg.attn_logit_softcapping
        if isinstance(mask, Mask):  # a prefill chunk over the whole cache, by blocks
            attn = (attention_lib.flash(q, ck, cv, mask, scale, cap, cfg.attention_block)
                    if sinks is None else attention(q, ck, cv, mask.dense(), scale, cap, sinks))
        elif (cfg.numerics.decode_attention == "pallas" and q.shape[1] == 1
              and decode_attention_lib.fits(cfg.head_dim, cap, sinks)):
            # One token over the cache in one fused kernel (models/decode_attention.py).
            attn = decode_attention_lib.attend(q, ck, cv, mask, scale, decode_mesh)
        elif cfg.use_cudnn_attention(decode=True) and cap is None and sinks is None:
            # The cache's [B, K, S, Dh] viewed as cuDNN's [B, S, K, Dh]: a layout, not a copy.
            # A query always sees its own slot, so no row is fully masked.
            attn = jax.nn.dot_product_attention(q, jnp.swapaxes(ck, 1, 2),
                                                jnp.swapaxes(cv, 1, 2), mask=mask[:, None],
                                                scale=scale, implementation="cudnn")
        else:
            attn = attention(q, ck, cv, mask, scale, cap, sinks)
    else:
        attn = _attend(cfg, q, k, v, mask, mesh, key_order, sinks)
    x, stats, idx = _attn_out_and_mlp(cfg, p, x, attn, token_mask, expert_mesh, forced)
    return x, kbuf, vbuf, stats, idx


def _sinks(cfg: ModelConfig, p):
    """gpt-oss's per-head sink logits in the compute dtype (as the sampler holds them), or
    None."""
    return p["sinks"].astype(cfg.dtype) if "sinks" in p else None


def _qkv(cfg: ModelConfig, p, x, cos, sin):
    """A layer's queries [B, T, H, Dh] and keys, values [B, T, K, Dh], RoPE applied."""
    dt, eps, offset = cfg.dtype, cfg.rms_norm_eps, cfg.norm_offset
    h = rms_norm(x, p["attn_norm"], eps, dt, offset)
    q = lora.project(p, "wq", "btd,dhk->bthk", h, dt)
    k = lora.project(p, "wk", "btd,dhk->bthk", h, dt)
    v = lora.project(p, "wv", "btd,dhk->bthk", h, dt)
    if cfg.qkv_bias:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps, dt, offset)
        k = rms_norm(k, p["k_norm"], eps, dt, offset)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _attend(cfg: ModelConfig, q, k, v, mask: Mask, mesh=None, key_order=None, sinks=None):
    """Attention without a cache: q [B, T, H, Dh] over k, v [B, S, K, Dh] as `mask` says.
    `key_order`: the keys' positions come in this order (Decoder.sequence_order; None:
    sequence order). With a context axis in `mesh` the queries stay split over it by position
    and the keys are gathered whole (attention.context_parallel). sinks [H]: gpt-oss's
    per-head sink logits, which only XLA's attention takes."""
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    cap = cfg.attn_logit_softcapping
    k, v = (attention_lib.gather_keys(a, key_order, mesh) for a in (k, v))
    cp = mesh_lib.context_size(mesh)
    dense_only = mask.blocks is not None or mask.segments is not None
    split = cp > 1 and q.shape[1] % cp == 0 and not dense_only
    rows = q.shape[0] // (mesh_lib.batch_divisor(mesh) if mesh is not None else 1) or 1
    kernel = cfg.attention_kernel(k.shape[1], context_parallel=split, queries=q.shape[1],
                                  rows=rows)
    if sinks is not None or (dense_only and kernel != "cudnn"):
        # Neither cuDNN nor the blockwise kernels take sinks, nor the others blocks or segments.
        kernel = "xla"
    if kernel == "cudnn":
        # Each query also sees itself, so padding rows are never fully masked (NaN in cuDNN).
        own = jnp.arange(k.shape[1])[None, :] == jnp.asarray(mask.q_idx)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=(mask.dense() | own[None])[:, None],
                                            scale=scale, implementation="cudnn")
    if kernel == "splash":
        if mesh is not None and attention_lib.splash_fits(q.shape[1], k.shape[1],
                                                          cfg.attention_block, cp if split else 1):
            def run(window):
                return attention_lib.splash(q, k, v, mask._replace(window=window), scale, cap,
                                            cfg.attention_block, mesh)
            if mask.window is None or isinstance(mask.window, int):
                return run(mask.window)
            # Layers of both kinds in one scan: the kernel's mask is static, so both run
            # under a cond on the layer's traced window.
            return jax.lax.cond(mask.window < 2 ** 30, lambda: run(cfg.sliding_window),
                                lambda: run(None))
        kernel = "flash"  # no mesh to lay the kernel out on, or blocks that do not tile
    if kernel == "flash":
        def attend(q, k, v, m):
            return attention_lib.flash(q, k, v, m, scale, cap, cfg.attention_block)
    else:
        def attend(q, k, v, m):
            return attention(q, k, v, m.dense(), scale, cap, sinks)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    if split:
        return attention_lib.context_parallel(attend, q, k, v, mask, mesh)
    return attend(q, k, v, mask)


def _attn_out_and_mlp(cfg: ModelConfig, p, x, attn, token_mask=None, mesh=None, forced=None):
    """The rest of a layer after attention: output projection, residual, MLP (a sparse
    layer's experts: moe.moe_mlp, `forced` its replayed experts), residual. Returns (x,
    RouterStats or None, the experts [B, T, k] or None)."""
    dt, eps, offset = cfg.dtype, cfg.rms_norm_eps, cfg.norm_offset
    out = lora.project(p, "wo", "bthk,hkd->btd", attn, dt)
    if cfg.o_bias:
        out = out + p["bo"].astype(dt)
    if cfg.sandwich_norms:
        out = rms_norm(out, p["post_attn_norm"], eps, dt, offset)
    x = x + out
    h = rms_norm(x, p["mlp_norm"], eps, dt, offset)
    stats = idx = None
    if "we_gate" in p:
        out, stats, idx = moe.moe_mlp(cfg, p, h, token_mask, mesh, forced)
    else:
        gate = lora.project(p, "w_gate", "btd,df->btf", h, dt)
        up = lora.project(p, "w_up", "btd,df->btf", h, dt)
        out = lora.project(p, "w_down", "btf,fd->btd", moe.gated(cfg, gate, up), dt)
    if cfg.sandwich_norms:
        out = rms_norm(out, p["post_mlp_norm"], eps, dt, offset)
    return x + out, stats, idx


def per_token(chosen):
    """Experts [S, B, T, k] (sparse layers first, as the layer scans stack them) -> [B, T, S,
    k], a token's record together; None (a dense model) stays None."""
    return None if chosen is None else jnp.moveaxis(chosen, 0, 2)


def _unorder(x, order):
    """x [B, T, ...] computed in `order` (Decoder.sequence_order) back in sequence order."""
    if x is None or order is None:
        return x
    return x[:, attention_lib.inverse(order)]


def _write(buf, layer, new, index, window: int | None):
    """New keys or values [B, T, K, Dh] into layer `layer` of the run's cache buffer
    [L, B, K, S, Dh] at positions index + t (index None: 0). A sliding layer's buffer is a ring
    of `window` slots when it is shorter than the positions: of a long prefill only the last
    `window` tokens stay."""
    new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    if index is not None and jnp.ndim(index) == 1:
        return _write_rows(buf, layer, new, index, window)
    start, T, slots = 0 if index is None else index, new.shape[2], buf.shape[3]
    if window is not None:
        if T == 1:
            start = start % window
        elif index is not None and slots >= window:
            # Several tokens into a ring at once: a later one would overwrite a key an earlier
            # query still sees. The sampler only prefills (index None) or decodes one token.
            raise NotImplementedError("writing several tokens into a sliding-window ring cache")
        elif T > slots:  # a prefill longer than the ring: its last `slots` tokens, wrapped
            at = (start + jnp.arange(T - slots, T)) % window
            return buf.at[layer].set(buf[layer].at[:, :, at].set(new[:, :, T - slots:]))
    at = [jnp.asarray(i, jnp.int32) for i in (layer, 0, 0, start, 0)]  # one dtype, also in x64
    return jax.lax.dynamic_update_slice(buf, new[None], at)


def _write_rows(buf, layer, new, index, window: int | None):
    """One token per row [B, K, 1, Dh] into layer `layer` of buf [L, B, K, S, Dh], row b at
    its own slot index[b] (position index[b] % window in a sliding layer's ring): a scatter, in
    place in a decode loop. For decode slots whose rows started at different times
    (rollout/native/refill.py)."""
    if new.shape[2] != 1:
        raise NotImplementedError("per-row cache indices write one token per row")
    slot = index if window is None else index % window
    return buf.at[layer, jnp.arange(buf.shape[1]), :, slot].set(new[:, :, 0])


def attention(q, k, v, mask, scale: float, cap: float | None = None, sinks=None):
    """Grouped-query attention of q [B, T, H, Dh] over keys/values k, v [B, K, S, Dh];
    mask [B, T, S] says which keys each query sees; scores are scaled by `scale` and
    soft-capped at `cap` (Gemma 2). sinks [H] (gpt-oss): one more logit per head in each
    softmax, whose probability is dropped (the weights then sum to less than 1).
    Returns [B, T, H, Dh]."""
    B, T, H, Dh = q.shape
    K = k.shape[1]
    # Queries grouped by their KV head, with (b, k) leading like the keys. For one token
    # (decode) the [B, 1, H, Dh] -> [B, K, G, Dh] reshape moves no data.
    qg = q.reshape(B, K, H // K, Dh) if T == 1 else (
        q.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, -1, Dh))
    s = jnp.einsum("bkqd,bksd->bkqs", qg, k.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    s = softcap(s, cap).reshape(B, K, H // K, T, -1)
    # A finite floor (not -inf) keeps fully masked rows (padding queries) free of NaN.
    s = jnp.where(mask[:, None, None], s, -1e30)
    if sinks is None:
        probs = jax.nn.softmax(s, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, H // K, 1, 1),
                                (*s.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(v.dtype).reshape(B, K, (H // K) * T, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(B, K, H // K, T, Dh)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)
