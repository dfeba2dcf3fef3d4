"""One decoder-only transformer for the Llama, Qwen2 and Qwen3 families (Flax NNX).

Layers are stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not
grow with depth. Every parameter carries logical axis names in its `axes` metadata; `mesh.py` maps
them to mesh axes with one rule table.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.config import ModelConfig

# name -> (shape, logical axes). L layers, D embed, H heads, K kv heads, Dh head dim, F mlp, V vocab.
def param_table(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    L, D, H, K = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    Dh, F, V = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    table = {
        "embed": ((V, D), ("vocab", "embed")),                          # [V, D]
        "final_norm": ((D,), ("norm",)),                                # [D]
        "layers/attn_norm": ((L, D), ("layers", "norm")),               # [L, D]
        "layers/wq": ((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "layers/wk": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "layers/wv": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "layers/wo": ((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "layers/mlp_norm": ((L, D), ("layers", "norm")),                # [L, D]
        "layers/w_gate": ((L, D, F), ("layers", "embed", "mlp")),       # [L, D, F]
        "layers/w_up": ((L, D, F), ("layers", "embed", "mlp")),         # [L, D, F]
        "layers/w_down": ((L, F, D), ("layers", "mlp", "embed")),       # [L, F, D]
    }
    if cfg.qkv_bias:
        table["layers/bq"] = ((L, H, Dh), ("layers", "heads", "head_dim"))
        table["layers/bk"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
        table["layers/bv"] = ((L, K, Dh), ("layers", "kv_heads", "head_dim"))
    if cfg.qk_norm:
        table["layers/q_norm"] = ((L, Dh), ("layers", "head_dim"))
        table["layers/k_norm"] = ((L, Dh), ("layers", "head_dim"))
    if not cfg.tie_word_embeddings:
        table["lm_head"] = ((D, V), ("embed", "vocab"))                 # [D, V]
    return table


def _init_value(name: str, shape, dtype, key):
    leaf = name.split("/")[-1]
    if leaf.endswith("norm"):
        return jnp.ones(shape, dtype)
    if leaf.startswith("b"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, K, Dh] in the compute dtype
    v: jax.Array  # [L, B, S, K, Dh]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int) -> "KVCache":
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


class _Layers(nnx.Module):
    """Holder for the stacked per-layer parameters."""


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, init: dict | None = None):
        """`init` maps table names to arrays (e.g. loaded weights); the rest are drawn at random."""
        self.cfg = cfg
        self.layers = _Layers()
        for name, (shape, axes) in param_table(cfg).items():
            if init is not None and name in init:
                value = jnp.asarray(init[name], cfg.param_dtype)
                if value.shape != shape:
                    raise ValueError(f"param {name}: shape {value.shape}, expected {shape}")
            else:
                value = _init_value(name, shape, cfg.param_dtype, rngs.params())
            owner, leaf = (self.layers, name[7:]) if name.startswith("layers/") else (self, name)
            setattr(owner, leaf, nnx.Param(value, axes=axes))

    def head_weight(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        w = self.head_weight().astype(self.cfg.dtype)
        return jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions, attention_mask, cache: KVCache | None = None,
                 cache_index=None):
        """Run the decoder and return (hidden [B, T, D] after the final norm, new cache).

        tokens, positions: [B, T] int. Without a cache, attention_mask is [B, T] (1 = real token)
        and attention is causal over the T tokens. With a cache of S slots, the T new tokens are
        written at slots [cache_index, cache_index + T) and attention_mask is [B, S]: which slots
        hold real tokens.
        """
        cfg = self.cfg
        x = self.embed[...].astype(cfg.dtype)[tokens]
        cos, sin = rope_tables(cfg, positions)
        B, T = tokens.shape
        key_ok = attention_mask.astype(bool)
        causal = jnp.tril(jnp.ones((T, T), bool))
        if cache is None:
            masks = (causal[None] & key_ok[:, None, :], None)
        else:
            # Two key blocks: the cache's earlier slots (read, never copied) and the T new
            # tokens; they are written into the cache once, after all layers.
            S = cache.k.shape[2]
            old = key_ok & (jnp.arange(S) < cache_index)[None]
            new = jax.lax.dynamic_slice_in_dim(key_ok, cache_index, T, axis=1)
            masks = (causal[None] & new[:, None, :], jnp.broadcast_to(old[:, None], (B, T, S)))
        layer_params = {name[7:]: getattr(self.layers, name[7:])[...]
                        for name in param_table(cfg) if name.startswith("layers/")}

        def body(x, xs):
            p, ck, cv = xs
            x, k, v = _block(cfg, p, x, cos, sin, masks, ck, cv)
            return x, (None, None) if cache is None else (k, v)

        if cfg.remat and cache is None:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        xs = (layer_params, None, None) if cache is None else (layer_params, cache.k, cache.v)
        unroll = cfg.num_layers if (cache is not None and cfg.use_unrolled_decode()) else 1
        x, (k_new, v_new) = jax.lax.scan(body, x, xs, unroll=unroll)
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.dtype)
        if cache is None:
            return x, None
        put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, new.astype(buf.dtype), cache_index, axis=2)
        return x, KVCache(put(cache.k, k_new), put(cache.v, v_new))


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions for a left-padded batch: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def rms_norm(x, weight, eps, dtype):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(dtype)


def rope_tables(cfg: ModelConfig, positions):
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope_llama3:
        inv_freq = _llama3_scale(inv_freq, *cfg.rope_llama3)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


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


def _block(cfg: ModelConfig, p, x, cos, sin, masks, ck, cv):
    """One layer. Returns the new x and this layer's keys/values for the T input tokens."""
    dt = cfg.dtype
    w = lambda name: p[name].astype(dt)  # noqa: E731
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, dt)
    q = jnp.einsum("btd,dhk->bthk", h, w("wq"))
    k = jnp.einsum("btd,dhk->bthk", h, w("wk"))
    v = jnp.einsum("btd,dhk->bthk", h, w("wv"))
    if cfg.qkv_bias:
        q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, dt)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, dt)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    new_mask, cache_mask = masks
    if ck is None and cfg.use_cudnn_attention():
        # Each query also sees itself, so padding rows are never fully masked (NaN in cuDNN).
        diag = jnp.eye(q.shape[1], dtype=bool)[None]
        attn = jax.nn.dot_product_attention(q, k, v, mask=(new_mask | diag)[:, None],
                                            implementation="cudnn")
    else:
        attn = attention(q, k, v, new_mask, None if ck is None else (ck, cv, cache_mask))
    x = x + jnp.einsum("bthk,hkd->btd", attn, w("wo"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, dt)
    gate = jnp.einsum("btd,df->btf", h, w("w_gate"))
    up = jnp.einsum("btd,df->btf", h, w("w_up"))
    x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w("w_down"))
    return x, k, v


def attention(q, k, v, mask, cached=None):
    """Grouped-query attention of q [B,T,H,Dh] over k/v [B,T,K,Dh] (mask [B,T,T]) and, when
    given, a cache block (ck, cv [B,S,K,Dh], cache_mask [B,T,S]), with one softmax over both."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, Dh)

    def scores(keys, m):
        s = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(q.dtype),
                       preferred_element_type=jnp.float32) * (Dh ** -0.5)
        # A finite floor (not -inf) keeps fully masked rows (padding queries) free of NaN.
        return jnp.where(m[:, None, None], s, -1e30)

    blocks = [scores(k, mask)]
    if cached is not None:
        blocks.insert(0, scores(cached[0], cached[2]))
    probs = jax.nn.softmax(jnp.concatenate(blocks, axis=-1), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., -T:], v)
    if cached is not None:
        out = out + jnp.einsum("bkgts,bskd->btkgd", probs[..., :-T],
                               cached[1].astype(v.dtype))
    return out.reshape(B, T, H, Dh)
