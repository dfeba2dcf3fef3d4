"""The vision towers' linears with their LoRA adapters (SigLIP's and Qwen2.5-VL's forwards
share it): PEFT's one adapter per module, its dropout on the adapter's input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_jax.models import quant


def linear(p: dict, name: str, eq: str, x, dtype, index: int):
    """einsum(eq, x, W) for weight `name` of `p`, plus its LoRA adapter when `p` has one:
    A [in..., r] and (scaled) B [r, out...] over x's trailing `in` axes (a fused linear, such
    as Qwen2.5-VL's qkv, is one module: its delta lands before any split of the output), with
    PEFT's dropout on the adapter's input (torch's nn.Dropout) when `p` has a dropout key
    (lora.with_dropout; `index` tells the module's draws apart). A quantized weight (QLoRA's
    base: `p` holds its `<name>_qscale`) is dequantized to `dtype` here, in the matmul."""
    y = jnp.einsum(eq, x, quant.weight(p, name, dtype))
    if f"{name}_lora_a" not in p:
        return y
    if "lora_dropout_key" in p:
        rate = p["lora_dropout_rate"]
        keep = jax.random.bernoulli(jax.random.fold_in(p["lora_dropout_key"], index),
                                    1.0 - rate, x.shape)
        x = jnp.where(keep, x / (1.0 - rate).astype(dtype), jnp.zeros((), dtype))
    a, b = p[f"{name}_lora_a"].astype(dtype), p[f"{name}_lora_b"].astype(dtype)
    n_in = a.ndim - 1
    r = x.reshape(*x.shape[:x.ndim - n_in], math.prod(a.shape[:-1])) @ a.reshape(-1, a.shape[-1])
    return y + (r @ b.reshape(b.shape[0], -1)).reshape(y.shape)
