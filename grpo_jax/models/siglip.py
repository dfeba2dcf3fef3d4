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
from grpo_jax.models import tower_lora
from grpo_jax.models.tower_shape import TowerShape

MATMUL = "...i,io->...o"  # x W over x's last axis


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

    # models/config.py's VisionConfig: the table, the HF names and config.json of its side.
    def param_table(self, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return param_table(self, text_hidden)

    def hf_names(self) -> dict[str, tuple[str, tuple[tuple[int, ...], ...]]]:
        return HF_NAMES

    hf_anchors = property(lambda self: HF_ANCHORS)
    deepstack_layers = 0  # no features added inside the decoder (Qwen3-VL's DeepStack)

    def hf_export_name(self, key: str) -> str:
        """Gemma3ForConditionalGeneration's checkpoints nest the decoder's tensors ("model.",
        "lm_head.") under HF_TEXT_ROOT. The tower goes under the Hub's HUB_TOWER, not where
        transformers 5's save_pretrained puts it (TOWER): transformers loads both, vLLM (0.32)
        the Hub's only ("no module or parameter named 'vision_tower.embeddings'")."""
        if key.startswith(("model.", "lm_head.")):
            return HF_TEXT_ROOT + key
        return HUB_TOWER + key[len(TOWER):] if key.startswith(TOWER) else key

    def tower(self) -> "VisionTower":
        return VisionTower(self)

    def encoded(self, image_tokens: int, images: int | None = None):
        """A prompt's `image_tokens` as images of mm_tokens_per_image tokens each, every one
        image_size square; `images`, where given, must be their count."""
        count = image_tokens // self.mm_tokens_per_image
        if image_tokens % self.mm_tokens_per_image or images not in (None, count):
            raise ModelConfigError(
                f"{image_tokens} image tokens{'' if images is None else f' in {images} images'}"
                f": Gemma 3's images have {self.mm_tokens_per_image} each; give a multiple "
                "(as many images as it makes)")
        return TowerShape(count, self.num_patches,
                          self.hidden_size, self.intermediate_size, self.num_heads,
                          self.num_layers, self.num_layers, self.num_patches,
                          (self.num_channels, self.image_size, self.image_size))

    def to_hf(self, text_config: dict, tie_word_embeddings: bool) -> dict:
        """Gemma3ForConditionalGeneration's config.json around the decoder's `text_config`.
        vision_use_head False: Gemma 3 reads the patch states, not SigLIP's pooling head, which
        is neither loaded nor exported."""
        text = {k: v for k, v in text_config.items() if k != "architectures"}
        vision = {"model_type": "siglip_vision_model", "hidden_size": self.hidden_size,
                  "intermediate_size": self.intermediate_size,
                  "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                  "image_size": self.image_size, "patch_size": self.patch_size,
                  "num_channels": self.num_channels, "layer_norm_eps": self.layer_norm_eps,
                  "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
        return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": text, "vision_config": vision,
                "mm_tokens_per_image": self.mm_tokens_per_image,
                "image_token_index": self.image_token_id,
                "tie_word_embeddings": tie_word_embeddings}


def param_table(v: SiglipConfig, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, logical axes) of the tower and projector, under the decoder's "vision/"
    prefix. The axes follow the decoder's mesh rules (mesh.RULES), as Qwen2.5-VL's tower does:
    the tower's width is "embed" (FSDP), its fused heads "heads" and its MLP "mlp" (tensor),
    so no chip holds the whole frozen tower (SigLIP-So400m replicated in fp32 was 1.68 GB a
    chip, docs/scaling.md). L layers, Dv the tower's width, F its MLP width, D the decoder's.
    Names follow decoder._init_value's rules (a LayerNorm's "layernorm*" scale 1 and shift 0,
    biases "b*" 0, mm_norm Gemma's 1 + w) and keep "bias"/"norm" where the optimizer's
    decay mask reads them."""
    L, Dv, F, D = v.num_layers, v.hidden_size, v.intermediate_size, text_hidden
    p = v.patch_size
    table = {
        # [C, p, p, Dv]: the conv's kernel
        "patch_embed": ((v.num_channels, p, p, Dv), (None, None, None, "embed")),
        "bias_patch": ((Dv,), (None,)),
        "pos_embed": ((v.num_patches, Dv), (None, "embed")),
        "post_layernorm": ((Dv,), ("norm",)), "post_layernorm_bias": ((Dv,), ("norm",)),
        "mm_norm": ((Dv,), ("norm",)),       # the projector's RMSNorm (stored as w, scale 1 + w)
        "mm_proj": ((Dv, D), ("mlp", "embed")),
    }
    vec, heads, norm = ("layers", None), ("layers", "heads"), ("layers", "norm")
    for name, shape, axes in (
            ("layernorm1", (Dv,), norm), ("layernorm1_bias", (Dv,), norm),
            ("wq", (Dv, Dv), ("layers", "embed", "heads")), ("bq", (Dv,), heads),
            ("wk", (Dv, Dv), ("layers", "embed", "heads")), ("bk", (Dv,), heads),
            ("wv", (Dv, Dv), ("layers", "embed", "heads")), ("bv", (Dv,), heads),
            ("wo", (Dv, Dv), ("layers", "heads", "embed")), ("bo", (Dv,), vec),
            ("layernorm2", (Dv,), norm), ("layernorm2_bias", (Dv,), norm),
            ("fc1", (Dv, F), ("layers", "embed", "mlp")), ("bias_fc1", (F,), ("layers", "mlp")),
            ("fc2", (F, Dv), ("layers", "mlp", "embed")), ("bias_fc2", (Dv,), vec)):
        table["layers/" + name] = ((L, *shape), axes)
    return table


# Where transformers' save_pretrained puts Gemma3ForConditionalGeneration's tower and projector
# (hf.py finds them under other roots too: HF_ANCHORS), and its decoder.
TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."
HUB_TOWER = TOWER + "vision_model."  # where the Hub's Gemma 3 checkpoints keep it
HF_TEXT_ROOT = "language_model."
# root -> a tensor under it that every checkpoint has: where a checkpoint put the root instead
# ("vision_tower.vision_model." on the Hub, "model.vision_tower." in transformers 5).
HF_ANCHORS = {TOWER: "embeddings.patch_embedding.weight",
              PROJECTOR: "mm_input_projection_weight"}
_LINEAR, _VECTOR = ((1,), (0,)), ((0,),)
# table name (without "vision/") -> (HF tensor name ({i}: a tower layer), how our dims group into
# the HF tensor's, in HF order: hf.py's layout convention; torch Linear weights are [out, in]).
# The layers' groups are those of one layer (the stacked layer axis dropped).
HF_NAMES: dict[str, tuple[str, tuple[tuple[int, ...], ...]]] = {
    "patch_embed": (TOWER + "embeddings.patch_embedding.weight", ((3,), (0,), (1,), (2,))),
    "bias_patch": (TOWER + "embeddings.patch_embedding.bias", _VECTOR),
    "pos_embed": (TOWER + "embeddings.position_embedding.weight", ((0,), (1,))),
    "post_layernorm": (TOWER + "post_layernorm.weight", _VECTOR),
    "post_layernorm_bias": (TOWER + "post_layernorm.bias", _VECTOR),
    "mm_norm": (PROJECTOR + "mm_soft_emb_norm.weight", _VECTOR),
    "mm_proj": (PROJECTOR + "mm_input_projection_weight", ((0,), (1,))),  # already [Dv, D]
    **{"layers/" + ours: (TOWER + "encoder.layers.{i}." + theirs, groups)
       for ours, theirs, groups in (
        ("layernorm1", "layer_norm1.weight", _VECTOR),
        ("layernorm1_bias", "layer_norm1.bias", _VECTOR),
        ("wq", "self_attn.q_proj.weight", _LINEAR), ("bq", "self_attn.q_proj.bias", _VECTOR),
        ("wk", "self_attn.k_proj.weight", _LINEAR), ("bk", "self_attn.k_proj.bias", _VECTOR),
        ("wv", "self_attn.v_proj.weight", _LINEAR), ("bv", "self_attn.v_proj.bias", _VECTOR),
        ("wo", "self_attn.out_proj.weight", _LINEAR), ("bo", "self_attn.out_proj.bias", _VECTOR),
        ("layernorm2", "layer_norm2.weight", _VECTOR),
        ("layernorm2_bias", "layer_norm2.bias", _VECTOR),
        ("fc1", "mlp.fc1.weight", _LINEAR), ("bias_fc1", "mlp.fc1.bias", _VECTOR),
        ("fc2", "mlp.fc2.weight", _LINEAR), ("bias_fc2", "mlp.fc2.bias", _VECTOR))},
}


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
    lin = lambda w, x, i: tower_lora.linear(p, w, MATMUL, x, dt, i)  # noqa: E731
    h = layer_norm(x, p["layernorm1"], p["layernorm1_bias"], eps)
    heads = lambda w, b, i: (lin(w, h, i) + p[b].astype(dt)).reshape(  # noqa: E731
        *h.shape[:2], v.num_heads, v.head_dim)
    q, k, val = heads("wq", "bq", 0), heads("wk", "bk", 1), heads("wv", "bv", 2)
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(s * v.head_dim ** -0.5, axis=-1).astype(dt)
    attn = jnp.einsum("nhqk,nkhd->nqhd", probs, val).reshape(h.shape)
    x = x + lin("wo", attn, 3) + p["bo"].astype(dt)
    h = layer_norm(x, p["layernorm2"], p["layernorm2_bias"], eps)
    h = jax.nn.gelu(lin("fc1", h, 4) + p["bias_fc1"].astype(dt), approximate=True)
    return x + lin("fc2", h, 5) + p["bias_fc2"].astype(dt)


def encode(v: SiglipConfig, params: dict, pixels, dtype):
    """Images [N, C, H, W] -> their soft tokens [N, mm_tokens_per_image, D] in `dtype`: the
    tower's last hidden states, pooled, normalised and projected (Gemma3Model's
    get_image_features). `params`: param_table's names -> arrays, and the layers' LoRA
    adapters (VisionTower.adapters) when it has them."""
    patch = params["patch_embed"].astype(dtype).reshape(-1, v.hidden_size)  # [C p p, Dv]
    x = patchify(v, pixels.astype(dtype)) @ patch
    x = x + params["bias_patch"].astype(dtype) + params["pos_embed"].astype(dtype)
    layers = {k[7:]: w for k, w in params.items() if k.startswith("layers/")}
    x, _ = jax.lax.scan(lambda x, p: (_encoder_layer(v, x, p), None), x, layers)
    x = layer_norm(x, params["post_layernorm"], params["post_layernorm_bias"],
                   v.layer_norm_eps)
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
    """The tower's and projector's parameters (set by the Decoder from the vision table:
    vision/layers/..., vision/patch_embed, ...), its layers' LoRA adapters when
    models/lora.py gave it some (`layers.<leaf>_lora_a|b`, beside the stacked weights) and
    a quantized base's scales (`layers.<leaf>_qscale`, models/quant.py)."""

    # Set by models/lora.py (add_adapters, with_dropout) with adapters: as the Decoder's.
    lora_scale: float | None = None
    lora_dropout: float = 0.0
    lora_dropout_key: jax.Array | None = None

    def __init__(self, v: SiglipConfig):
        self.v = v
        self.layers = _Layers()

    def params(self) -> dict[str, jax.Array]:
        """param_table's names -> the current values, and a quantized base's scales
        (layers/<leaf>_qscale, models/quant.py)."""
        scales = {f"layers/{name}": var[...] for name, var in vars(self.layers).items()
                  if name.endswith("_qscale")}
        return {name: getattr(self.layers if name.startswith("layers/") else self,
                              name.split("/")[-1])[...] for name in HF_NAMES} | scales

    def adapters(self) -> dict[str, jax.Array]:
        """The layers' adapters by table name ({layers/<leaf>_lora_a: A, ..._lora_b: scale B}),
        and under with_dropout a dropout key and rate per layer; {} without adapters. B is
        scaled here, once per forward, as the decoder's (lora.layer_extras)."""
        if self.lora_scale is None:
            return {}
        out = {f"layers/{name}": var[...] * self.lora_scale if name.endswith("_lora_b")
               else var[...] for name, var in vars(self.layers).items() if "_lora_" in name}
        if self.lora_dropout_key is not None:
            L = self.v.num_layers
            out["layers/lora_dropout_key"] = jax.random.split(self.lora_dropout_key, L)
            out["layers/lora_dropout_rate"] = jnp.full((L,), self.lora_dropout, jnp.float32)
        return out

    def __call__(self, pixel_values, image_grid_thw, dtype):
        """(The images' soft tokens [N, mm_tokens_per_image, D], None: every one is its
        image's own); pixel_values [N, C, H, W] (every image at image_size: no grid,
        image_grid_thw is None)."""
        soft = encode(self.v, {**self.params(), **self.adapters()}, pixel_values, dtype)
        return soft.reshape(pixel_values.shape[0], -1, soft.shape[-1]), None
