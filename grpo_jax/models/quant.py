"""QLoRA's frozen base: the projection weights stored quantized, dequantized in the matmul.

`load_in_8bit`: int8 codes with one absmax scale per output channel (LLM.int8()'s row-wise
scaling, without its outlier decomposition). `load_in_4bit`: NF4 codes (QLoRA's 16 normal-float
levels) with one absmax scale per block of 64 inputs and output channel, as bitsandbytes'
blocksize 64 (no nested quantization of the scales). Codes keep the weight's own shape and
axes ([L, in..., out...], so sharding is unchanged); the scales are [L, blocks, out] fp32.

The decoder's seven projections are quantized (embedding, head and norms stay as loaded), and
on a vision-language model every nn.Linear of the vision tower and its projector
(tower_linears): transformers' bitsandbytes quantizer replaces every nn.Linear but lm_head (the
output embedding, tied weights and the model's last module: quantizers/base.py's
get_keys_to_not_convert), so under TRL's QLoRA recipe a VLM's tower is quantized too. Convs
(the patch embeddings), position embeddings and Gemma 3's projection (a bare nn.Parameter, not
an nn.Linear) stay as loaded. A weight outside a stack of layers (Qwen2.5-VL's merger) has
scales [blocks, out].
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


def tower_linears(vision) -> dict[str, tuple[str, int]]:
    """The nn.Linear modules of a vision config's tower and projector, by table name (without
    "vision/") -> (HF module name ({i}: each layer), inputs: how many of the weight's dims,
    after a stack's L, are contracted). A linear is a weight of two groups (torch's [out, in])
    beside a bias, which no conv kernel, embedding table or bare projection (Gemma 3's
    mm_input_projection_weight) of the towers has."""
    table = vision.hf_names()
    tensors = {hf_name for hf_name, _ in table.values()}
    return {name: (hf_name[:-len(".weight")], len(groups[1]))
            for name, (hf_name, groups) in table.items()
            if hf_name.endswith(".weight") and len(groups) == 2
            and hf_name[:-len("weight")] + "bias" in tensors}


def quantize_model(model, bits: int, scales: dict | None = None) -> None:
    """Replace the base's projection weights with their codes and add `<leaf>_qscale`, and
    the same for a vision tower's linears (quantize_tower). `scales` ({leaf: scales}): the
    decoder's weights are codes already (hf.load_model quantizes each as it is loaded, so no
    device holds the whole base unquantized); only the scales are added."""
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
    if model.vision is not None:
        quantize_tower(model.vision, model.cfg.vision, bits)


def quantize_tower(tower, vision, bits: int) -> None:
    """The linears of `tower` (a Decoder's vision submodule, of config `vision`) as codes,
    with their `<leaf>_qscale` beside them in the same holder (the stacked layers, or
    Qwen2.5-VL's merger). A tower is small beside its decoder (SigLIP-So400m 0.4B): each weight
    is quantized once loaded."""
    for name, (hf_name, n_in) in tower_linears(vision).items():
        part, leaf = name.split("/")
        holder = getattr(tower, part)
        var = getattr(holder, leaf)
        stacked = "{i}" in hf_name
        w = var.get_value()
        codes, scale = _quantize(w if stacked else w[None], n_in, bits)
        var.set_value(codes if stacked else codes[0])
        axes = var.axes if stacked else (None, *var.axes)
        scale = nnx.Param(scale if stacked else scale[0],
                          axes=(axes[0], axes[1], axes[1 + n_in])[int(not stacked):])
        setattr(holder, f"{leaf}_qscale", scale)


def weight(p: dict, leaf: str, dtype) -> jax.Array:
    """Layer params `p`'s weight `leaf` in `dtype`, dequantized when stored quantized."""
    if f"{leaf}_qscale" in p:
        return dequantize(p[leaf], p[f"{leaf}_qscale"], dtype)
    return p[leaf].astype(dtype)


def dequantized_base(base):
    """A base nnx.Param state with quantized weights back in float (the scales' dtype is
    fp32; the result takes the embedding's dtype) and no `_qscale` entries: the decoder's
    layers and a vision tower's holders (its stacked layers, Qwen2.5-VL's merger)."""
    if not any(name.endswith("_qscale") for name in base["layers"]):
        return base
    dtype = base["embed"].get_value().dtype
    out = {k: v for k, v in base.items() if k not in ("layers", "vision")}
    out["layers"] = _dequantized(base["layers"], dtype)
    if "vision" in base:
        out["vision"] = {k: v if isinstance(v, nnx.Variable) else _dequantized(v, dtype)
                         for k, v in base["vision"].items()}
    return nnx.State(out)


def _dequantized(holder, dtype) -> dict:
    """One holder's weights, those with `_qscale` entries dequantized (a stack when its scales
    are [L, blocks, out]), without the scales."""
    out = {}
    for name, var in holder.items():
        if name.endswith("_qscale"):
            continue
        if f"{name}_qscale" in holder:
            scale = holder[f"{name}_qscale"].get_value()
            var = var.replace(dequantize(var.get_value(), scale, dtype, stacked=scale.ndim == 3))
        out[name] = var
    return out
