"""Gemma 3's image encoder: the SigLIP vision tower and Gemma 3's multimodal projector
(transformers' SiglipVisionModel and Gemma3MultiModalProjector), as the optional `vision`
submodule of the one Decoder (models/decoder.py).

An image [C, H, W] (every image resized to image_size by Gemma 3's processor) is cut into
patches of patch_size, each projected to the tower's width (the stride-p convolution as one
matmul over the flattened patches), plus a learned embedding per patch position; pre-norm
encoder layers (LayerNorm, bidirectional attention with biases, a gelu-tanh MLP) and a final
LayerNorm follow. The projector average-pools the patch grid down to mm_tokens_per_image
tokens, RMS-normalises them (Gemma's 1 + w scale) and projects them to the decoder's width:
the embeddings the decoder reads in place of the image tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.errors import ModelConfigError


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """The tower's static settings (HF's vision_config), the projector's token count and the
    image placeholder's id (the wrapper's mm_tokens_per_image and image_token_index)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144  # the wrapper's image_token_index

    def __post_init__(self):
        side = math.isqrt(self.mm_tokens_per_image)
        if (self.image_size % self.patch_size or side * side != self.mm_tokens_per_image
                or self.patches_per_side % side):
            raise ModelConfigError(
                f"image_size {self.image_size} / patch_size {self.patch_size} must give a "
                f"square patch grid that pools evenly to mm_tokens_per_image "
                f"{self.mm_tokens_per_image} (a square)")

    patches_per_side = property(lambda self: self.image_size // self.patch_size)
    num_patches = property(lambda self: self.patches_per_side ** 2)
    tokens_per_side = property(lambda self: math.isqrt(self.mm_tokens_per_image))
    head_dim = property(lambda self: self.hidden_size // self.num_heads)

    @classmethod
    def from_hf(cls, vision: dict, mm_tokens_per_image: int,
                image_token_id: int) -> "SiglipConfig":
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ModelConfigError(f"vision hidden_act {vision['hidden_act']!r}: only "
                             "gelu_pytorch_tanh (SigLIP's) is supported")
        return cls(hidden_size=vision["hidden_size"],
                   intermediate_size=vision["intermediate_size"],
                   num_layers=vision["num_hidden_layers"],
                   num_heads=vision["num_attention_heads"],
                   image_size=vision["image_size"], patch_size=vision["patch_size"],
                   num_channels=vision.get("num_channels", 3),
                   layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                   mm_tokens_per_image=mm_tokens_per_image, image_token_id=image_token_id)

    def to_hf(self) -> dict:
        """HF's vision_config. vision_use_head False: Gemma 3 reads the patch states, not
        SigLIP's pooling head, which is neither loaded nor exported."""
        return {"model_type": "siglip_vision_model", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "image_size": self.image_size, "patch_size": self.patch_size,
                "num_channels": self.num_channels, "layer_norm_eps": self.layer_norm_eps,
                "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}


def param_table(v: SiglipConfig, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of the tower and projector. The tower is small next to the
    decoder (SigLIP-So400m: 0.4B), so its weights are replicated (axes None). L layers, Dv the
    tower's width, F its MLP width, D the decoder's."""
    L, Dv, F, D = v.num_layers, v.hidden_size, v.intermediate_size, text_hidden
    n = (None,)
    table = {
        "patch_embed": ((v.num_channels * v.patch_size ** 2, Dv), n * 2),  # [C p p, Dv]
        "patch_bias": ((Dv,), n),
        "pos_embed": ((v.num_patches, Dv), n * 2),
        "post_norm": ((Dv,), n), "post_norm_bias": ((Dv,), n),
        "mm_norm": ((Dv,), n),               # the projector's RMSNorm (stored as w, scale 1 + w)
        "mm_proj": ((Dv, D), n * 2),
    }
    for name, shape in (("ln1", (Dv,)), ("ln1_bias", (Dv,)), ("wq", (Dv, Dv)), ("bq", (Dv,)),
                        ("wk", (Dv, Dv)), ("bk", (Dv,)), ("wv", (Dv, Dv)), ("bv", (Dv,)),
                        ("wo", (Dv, Dv)), ("bo", (Dv,)), ("ln2", (Dv,)), ("ln2_bias", (Dv,)),
                        ("fc1", (Dv, F)), ("fc1_bias", (F,)), ("fc2", (F, Dv)),
                        ("fc2_bias", (Dv,))):
        table["layers/" + name] = ((L, *shape), n * (1 + len(shape)))
    return table


# name -> (HF tensor name under the tower's or projector's prefix, its layout): "linear" a
# torch Linear's [out, in] (ours [in, out]), "conv" the patch convolution's [Dv, C, p, p].
HF_NAMES = {
    "patch_embed": ("embeddings.patch_embedding.weight", "conv"),
    "patch_bias": ("embeddings.patch_embedding.bias", None),
    "pos_embed": ("embeddings.position_embedding.weight", None),
    "post_norm": ("post_layernorm.weight", None),
    "post_norm_bias": ("post_layernorm.bias", None),
    "mm_norm": ("mm_soft_emb_norm.weight", None),
    "mm_proj": ("mm_input_projection_weight", None),  # already [Dv, D]
    **{"layers/" + ours: ("encoder.layers.{i}." + theirs, layout) for ours, theirs, layout in (
        ("ln1", "layer_norm1.weight", None), ("ln1_bias", "layer_norm1.bias", None),
        ("wq", "self_attn.q_proj.weight", "linear"), ("bq", "self_attn.q_proj.bias", None),
        ("wk", "self_attn.k_proj.weight", "linear"), ("bk", "self_attn.k_proj.bias", None),
        ("wv", "self_attn.v_proj.weight", "linear"), ("bv", "self_attn.v_proj.bias", None),
        ("wo", "self_attn.out_proj.weight", "linear"), ("bo", "self_attn.out_proj.bias", None),
        ("ln2", "layer_norm2.weight", None), ("ln2_bias", "layer_norm2.bias", None),
        ("fc1", "mlp.fc1.weight", "linear"), ("fc1_bias", "mlp.fc1.bias", None),
        ("fc2", "mlp.fc2.weight", "linear"), ("fc2_bias", "mlp.fc2.bias", None))},
}
PROJECTOR = ("mm_norm", "mm_proj")  # under multi_modal_projector., the rest under vision_tower.


def from_hf_layout(w, layout):
    """An HF tensor (numpy) in our layout."""
    if layout == "linear":
        return w.T
    if layout == "conv":  # [Dv, C, p, p] -> [C p p, Dv]: the patch flattened as (c, y, x)
        return w.reshape(w.shape[0], -1).T
    return w


def to_hf_layout(w, layout, v: SiglipConfig):
    if layout == "linear":
        return w.T
    if layout == "conv":
        return w.T.reshape(-1, v.num_channels, v.patch_size, v.patch_size)
    return w


def layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def patchify(v: SiglipConfig, pixels):
    """[N, C, H, W] -> [N, P*P, C*p*p]: the patches row by row (the convolution's output
    order), each flattened as the conv kernel is, (c, y, x)."""
    N, C, P, p = pixels.shape[0], v.num_channels, v.patches_per_side, v.patch_size
    x = pixels.reshape(N, C, P, p, P, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(N, P * P, C * p * p)


def _encoder_layer(v: SiglipConfig, x, p):
    """One pre-norm SigLIP layer over x [N, S, Dv]: every patch attends to every patch."""
    dt, eps = x.dtype, v.layer_norm_eps
    h = layer_norm(x, p["ln1"], p["ln1_bias"], eps)
    heads = lambda w, b: (h @ w.astype(dt) + b.astype(dt)).reshape(  # noqa: E731
        *h.shape[:2], v.num_heads, v.head_dim)
    q, k, val = heads(p["wq"], p["bq"]), heads(p["wk"], p["bk"]), heads(p["wv"], p["bv"])
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(s * v.head_dim ** -0.5, axis=-1).astype(dt)
    attn = jnp.einsum("nhqk,nkhd->nqhd", probs, val).reshape(h.shape)
    x = x + attn @ p["wo"].astype(dt) + p["bo"].astype(dt)
    h = layer_norm(x, p["ln2"], p["ln2_bias"], eps)
    h = jax.nn.gelu(h @ p["fc1"].astype(dt) + p["fc1_bias"].astype(dt), approximate=True)
    return x + h @ p["fc2"].astype(dt) + p["fc2_bias"].astype(dt)


def encode(v: SiglipConfig, params: dict, pixels, dtype):
    """Images [N, C, H, W] -> their soft tokens [N, mm_tokens_per_image, D] in `dtype`: the
    tower's last hidden states, pooled, normalised and projected (Gemma3Model's
    get_image_features). `params`: param_table's names -> arrays."""
    x = patchify(v, pixels.astype(dtype)) @ params["patch_embed"].astype(dtype)
    x = x + params["patch_bias"].astype(dtype) + params["pos_embed"].astype(dtype)
    layers = {k[7:]: w for k, w in params.items() if k.startswith("layers/")}
    x, _ = jax.lax.scan(lambda x, p: (_encoder_layer(v, x, p), None), x, layers)
    x = layer_norm(x, params["post_norm"], params["post_norm_bias"], v.layer_norm_eps)
    # Average-pool the P x P patch grid by k x k windows to tokens_per_side x tokens_per_side
    # (HF's AvgPool2d over the grid, row-major in and out).
    N, T, Dv = x.shape[0], v.tokens_per_side, x.shape[-1]
    k = v.patches_per_side // T
    x = x.astype(jnp.float32).reshape(N, T, k, T, k, Dv).mean((2, 4)).reshape(N, T * T, Dv)
    # Gemma3RMSNorm: fp32, scaled by 1 + w, then back to the tower's dtype.
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + v.layer_norm_eps)
    x = (x * (1.0 + params["mm_norm"].astype(jnp.float32))).astype(dtype)
    return x @ params["mm_proj"].astype(dtype)


class _Layers(nnx.Module):
    """Holder for the tower's stacked per-layer parameters."""


class VisionTower(nnx.Module):
    """The tower's and projector's parameters (random here; hf.py loads real ones)."""

    def __init__(self, v: SiglipConfig, text_hidden: int, param_dtype, *, rngs: nnx.Rngs):
        self.v = v
        self.layers = _Layers()
        for name, (shape, axes) in param_table(v, text_hidden).items():
            leaf = name.split("/")[-1]
            if "norm" in leaf or leaf.startswith("ln"):
                # LayerNorm scales start at 1, their biases at 0; the projector's RMSNorm
                # stores w of its (1 + w) scale, 0.
                value = jnp.full(shape, 1.0 if leaf in ("ln1", "ln2", "post_norm") else 0.0)
            elif leaf.startswith("b") or leaf.endswith("bias"):
                value = jnp.zeros(shape)
            else:
                value = 0.02 * jax.random.normal(rngs.params(), shape)
            owner = self.layers if name.startswith("layers/") else self
            setattr(owner, leaf, nnx.Param(value.astype(param_dtype), axes=axes))

    def params(self) -> dict[str, jax.Array]:
        """param_table's names -> the current values."""
        return {name: getattr(self.layers if name.startswith("layers/") else self,
                              name.split("/")[-1])[...] for name in HF_NAMES}

    def __call__(self, pixel_values, image_grid_thw, dtype):
        """The images' soft tokens [N * mm_tokens_per_image, D]; pixel_values [N, C, H, W]
        (every image at image_size: no grid, image_grid_thw is None)."""
        soft = encode(self.v, self.params(), pixel_values, dtype)
        return soft.reshape(-1, soft.shape[-1])
