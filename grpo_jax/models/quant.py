"""QLoRA's frozen base: the projection weights stored quantized, dequantized in the matmul.

`load_in_8bit`: int8 codes with one absmax scale per output channel (LLM.int8()'s row-wise
scaling, without its outlier decomposition). `load_in_4bit`: NF4 codes (QLoRA's 16 normal-float
levels) with one absmax scale per block of 64 inputs and output channel, as bitsandbytes'
blocksize 64 (no nested quantization of the scales). Codes keep the weight's own shape and
axes ([L, in..., out...], so sharding is unchanged); the scales are [L, blocks, out] fp32.

Only the seven projections are quantized (embedding, head and norms stay as loaded), as
bitsandbytes quantizes nn.Linear layers but not lm_head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.config.model import PROJECTIONS  # noqa: F401 (this module's API)

# QLoRA's NF4 levels (bitsandbytes' table): quantiles of N(0, 1) scaled to [-1, 1].
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
BLOCK = 64


def num_inputs(leaf: str) -> int:
    """How many leading (after L) dims of a projection weight are contracted with the input."""
    return 2 if leaf == "wo" else 1  # wo [L, H, Dh, D]; the rest [L, D_in, ...]


def _blocks(shape, n_in: int, bits: int) -> tuple[int, int, int]:
    """(blocks, block size, outputs) of one layer's [in..., out...] weight."""
    inputs, outputs = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    size = BLOCK if bits == 4 and inputs % BLOCK == 0 else inputs
    return inputs // size, size, outputs


def quantize(w: jax.Array, n_in: int, bits: int) -> tuple[jax.Array, jax.Array]:
    """Stacked [L, in..., out...] weight -> (codes of w's shape, scales [L, blocks, out])."""
    L = w.shape[0]
    nb, size, out = _blocks(w.shape[1:], n_in, bits)
    x = w.astype(jnp.float32).reshape(L, nb, size, out)
    absmax = jnp.max(jnp.abs(x), axis=2, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    if bits == 8:
        codes = jnp.clip(jnp.round(x / safe * 127), -127, 127).astype(jnp.int8)
        scale = absmax / 127
    else:
        levels = jnp.asarray(NF4, jnp.float32)
        codes = jnp.argmin(jnp.abs((x / safe)[..., None] - levels), axis=-1).astype(jnp.uint4)
        scale = absmax
    return codes.reshape(w.shape), scale.reshape(L, nb, out)


def dequantize(codes: jax.Array, scale: jax.Array, dtype, stacked: bool = False) -> jax.Array:
    """One layer's codes [in..., out...] and scales [blocks, out] -> the weight in `dtype`
    (computed in fp32); `stacked`: a [L, ...] pair (scale [L, blocks, out])."""
    lead = int(stacked)
    nb, out = scale.shape[-2:]
    values = (jnp.asarray(NF4, jnp.float32)[codes.astype(jnp.int32)]
              if codes.dtype == jnp.uint4 else codes.astype(jnp.float32))
    x = values.reshape(*codes.shape[:lead], nb, -1, out) * scale[..., None, :]
    return x.reshape(codes.shape).astype(dtype)


# A layer at a time: the fp32 copy (and NF4's distances to the 16 levels) of one layer, not of
# the stacked weight, is what the quantization needs on top of the weight itself.
_quantize = jax.jit(lambda w, n_in, bits: jax.tree.map(
    lambda x: x[:, 0], jax.lax.map(lambda layer: quantize(layer[None], n_in, bits), w)),
    static_argnums=(1, 2))


def quantize_stacked(w: jax.Array, leaf: str, bits: int) -> tuple[jax.Array, jax.Array]:
    """Stacked weight `leaf` -> (codes, scales), as quantize_model stores them."""
    return _quantize(w, num_inputs(leaf), bits)


def quantize_model(model, bits: int, scales: dict | None = None) -> None:
    """Replace the base's projection weights with their codes and add `<leaf>_qscale`.
    `scales` ({leaf: scales}): the weights are codes already (hf.load_model quantizes each as it
    is loaded, so no device holds the whole base unquantized); only the scales are added."""
    for leaf in PROJECTIONS:
        var = getattr(model.layers, leaf, None)
        if var is None:  # a mixture of experts' sparse layers: experts stay unquantized
            continue
        if scales is None:
            codes, scale = quantize_stacked(var.get_value(), leaf, bits)
            var.set_value(codes)
        else:
            scale = scales[leaf]
        n_in = num_inputs(leaf)
        # [L, blocks, out]: blocks split like the weight's first input dim, out like its first
        # output dim (NF4's scales are 1/16 byte per weight: replicated, 70B's would be 4 GB).
        setattr(model.layers, f"{leaf}_qscale",
                nnx.Param(scale, axes=(var.axes[0], var.axes[1], var.axes[1 + n_in])))


def weight(p: dict, leaf: str, dtype) -> jax.Array:
    """Layer params `p`'s weight `leaf` in `dtype`, dequantized when stored quantized."""
    if f"{leaf}_qscale" in p:
        return dequantize(p[leaf], p[f"{leaf}_qscale"], dtype)
    return p[leaf].astype(dtype)


def dequantized_base(base):
    """A base nnx.Param state with quantized weights back in float (the scales' dtype is
    fp32; the result takes the embedding's dtype) and no `_qscale` entries."""
    layers = base["layers"]
    if not any(name.endswith("_qscale") for name in layers):
        return base
    dtype = base["embed"].get_value().dtype
    out = {k: v for k, v in base.items() if k != "layers"}
    out["layers"] = {}
    for name, var in layers.items():
        if name.endswith("_qscale"):
            continue
        if f"{name}_qscale" in layers:
            var = var.replace(dequantize(var.get_value(), layers[f"{name}_qscale"].get_value(),
                                         dtype, stacked=True))
        out["layers"][name] = var
    return nnx.State(out)
