"""Qwen3-VL's vision side (transformers' modeling_qwen3_vl.py and vision_utils.py are the
reference): a ViT whose features replace the image placeholders' embeddings, as Qwen2.5-VL's
(models/qwen_vl.py, whose 2-D RoPE, per-frame attention and M-RoPE positions it shares), with
three differences:
- a learned position embedding on a square grid, bilinearly resampled to each image's patch
  grid (align_corners), added after the Conv3d patch embedding (which has a bias here);
- LayerNorms and a GELU MLP with biases in the blocks, every block attending over its whole
  frame (no windows), the patches in the processor's order throughout;
- DeepStack: after each block of deepstack_visual_indexes a merger of its own makes features
  that the language model adds to the hidden states at the image positions after its first
  layers (the j-th merger's after layer j).
The tower returns the main merger's features and the DeepStack ones side by side, [n, D * (1 +
K)] for K DeepStack mergers: embed_multimodal scatters them into inputs_embeds of that width,
and the decoder takes the DeepStack part off and adds it in its first K layers (one array
through every path that carries input embeddings: the sampler's prefill, the trainer, shared
prefixes, tool turns)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from grpo_jax.errors import ModelConfigError
from grpo_jax.models import qwen_vl, tower_lora
from grpo_jax.models.tower_shape import TowerShape

MODEL_TYPE = "qwen3_vl"
# Its checkpoints (and transformers 5's save_pretrained) keep the tower under this root and
# the decoder under "model.language_model.".
HF_ROOT = "model.visual."
VISION_EPS = 1e-6  # HF's vision LayerNorms have a fixed eps
_ACTS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
         "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig:
    """The vision tower's static settings (HF's vision_config) and the placeholder token ids
    of the checkpoint's top-level config."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size
    num_position_embeddings: int = 2304  # a square grid of learned positions
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3VisionConfig":
        """From a Qwen3-VL config.json (its vision_config and top-level token ids)."""
        v = hf["vision_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ModelConfigError(f"Qwen3-VL vision hidden_act {act!r}: supported are "
                                   f"{', '.join(_ACTS)}")
        side = math.isqrt(v.get("num_position_embeddings", 2304))
        if side * side != v.get("num_position_embeddings", 2304):
            raise ModelConfigError("Qwen3-VL num_position_embeddings must be a square")
        indexes = tuple(v.get("deepstack_visual_indexes", (8, 16, 24)))
        if list(indexes) != sorted(set(indexes)) or (indexes and indexes[-1] >= v["depth"]):
            raise ModelConfigError(f"Qwen3-VL deepstack_visual_indexes {list(indexes)}: give "
                                   f"increasing block indexes below depth {v['depth']}")
        rope = v.get("rope_parameters") or {}
        ids = {k: hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id") if k in hf}
        return cls(depth=v["depth"], hidden_size=v["hidden_size"],
                   intermediate_size=v["intermediate_size"], num_heads=v["num_heads"],
                   out_hidden_size=v["out_hidden_size"],
                   num_position_embeddings=v.get("num_position_embeddings", 2304),
                   deepstack_visual_indexes=indexes,
                   hidden_act=act, in_channels=v.get("in_channels", 3),
                   patch_size=v.get("patch_size", 16),
                   temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   rope_theta=float(rope.get("rope_theta", 10000.0)), **ids)

    # models/config.py's VisionConfig.
    hf_anchors = property(lambda self: {HF_ROOT: "patch_embed.proj.weight"})

    def hf_export_name(self, key: str) -> str:
        """transformers 5's Qwen3VLForConditionalGeneration keeps the decoder's "model." under
        "model.language_model." (lm_head and the tower where they are)."""
        if key.startswith("model.") and not key.startswith(HF_ROOT):
            return "model.language_model." + key[len("model."):]
        return key

    @property
    def deepstack_layers(self) -> int:
        """The decoder layers after which DeepStack features are added (the first K)."""
        return len(self.deepstack_visual_indexes)

    def param_table(self, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return param_table(self)

    def hf_names(self) -> dict[str, tuple[str, tuple[tuple[int, ...], ...]]]:
        return HF_NAMES

    def tower(self) -> "Qwen3Vision":
        return Qwen3Vision(self)

    def image_grid(self, tokens: int) -> tuple[tuple[int, int, int], ...]:
        return qwen_vl.image_grid(tokens, self.spatial_merge_size)

    def encoded(self, image_tokens: int, images: int | None = None):
        """A prompt's `image_tokens` merged tokens as `images` images (default one) of equal
        size; every block attends over its whole image."""
        images = images or 1
        if image_tokens % images:
            raise ModelConfigError(f"{image_tokens} image tokens in {images} images: Qwen3-VL's "
                                   "images of a prompt share one size; give a multiple")
        t, h, w = self.image_grid(image_tokens // images)[0]
        return TowerShape(images, t * h * w, self.hidden_size, self.intermediate_size,
                          self.num_heads, self.depth, self.depth, t * h * w,
                          (t * h * w, self.in_channels * self.temporal_patch_size
                           * self.patch_size ** 2))

    def to_hf(self, text_config: dict, tie_word_embeddings: bool) -> dict:
        """Qwen3-VL's config.json around the decoder's `text_config`."""
        text = {**text_config, "model_type": "qwen3_vl_text"}
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(
            model_type="qwen3_vl_vision", depth=self.depth, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_heads=self.num_heads,
            out_hidden_size=self.out_hidden_size,
            num_position_embeddings=self.num_position_embeddings,
            deepstack_visual_indexes=list(self.deepstack_visual_indexes),
            hidden_act=self.hidden_act, in_channels=self.in_channels,
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            spatial_merge_size=self.spatial_merge_size,
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        return {"architectures": text.pop("architectures"), "model_type": MODEL_TYPE,
                "text_config": text, "tie_word_embeddings": tie_word_embeddings,
                "vision_config": vision, "image_token_id": self.image_token_id,
                "video_token_id": self.video_token_id,
                "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_shape(self) -> tuple[int, int, int, int]:
        return (self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)


# name -> (shape, logical axes), under "vision/". L blocks, E width, H heads, Dh head dim, F MLP
# width, U = E * merge_unit (a merged unit), O the language model's width, K DeepStack mergers,
# G the learned position grid's entries.
def param_table(v: Qwen3VisionConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    L, E, H, Dh, F = v.depth, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size
    U, O, K = E * v.merge_unit, v.out_hidden_size, v.deepstack_layers
    table = {
        "patch_embed": ((*v.patch_shape, E), (None, None, None, None, "embed")),
        "patch_bias": ((E,), (None,)),
        "pos_embed": ((v.num_position_embeddings, E), (None, "embed")),
        "blocks/attn_norm": ((L, E), ("layers", "norm")),
        "blocks/attn_norm_bias": ((L, E), ("layers", None)),
        "blocks/wqkv": ((L, E, 3, H, Dh), ("layers", "embed", None, "heads", "head_dim")),
        "blocks/bqkv": ((L, 3, H, Dh), ("layers", None, "heads", "head_dim")),
        "blocks/wo": ((L, H, Dh, E), ("layers", "heads", "head_dim", "embed")),
        "blocks/bo": ((L, E), ("layers", None)),
        "blocks/mlp_norm": ((L, E), ("layers", "norm")),
        "blocks/mlp_norm_bias": ((L, E), ("layers", None)),
        "blocks/w_fc1": ((L, E, F), ("layers", "embed", "mlp")),
        "blocks/b_fc1": ((L, F), ("layers", "mlp")),
        "blocks/w_fc2": ((L, F, E), ("layers", "mlp", "embed")),
        "blocks/b_fc2": ((L, E), ("layers", None)),
        "merger/norm": ((E,), ("norm",)),
        "merger/norm_bias": ((E,), (None,)),
        "merger/w1": ((U, U), ("embed", "mlp")),
        "merger/b1": ((U,), ("mlp",)),
        "merger/w2": ((U, O), ("mlp", "embed")),
        "merger/b2": ((O,), (None,)),
    }
    if K:
        table |= {
            "deepstack/norm": ((K, U), ("layers", "norm")),
            "deepstack/norm_bias": ((K, U), ("layers", None)),
            "deepstack/w1": ((K, U, U), ("layers", "embed", "mlp")),
            "deepstack/b1": ((K, U), ("layers", "mlp")),
            "deepstack/w2": ((K, U, O), ("layers", "mlp", "embed")),
            "deepstack/b2": ((K, O), ("layers", None)),
        }
    return table


_B, _D = HF_ROOT + "blocks.{i}.", HF_ROOT + "deepstack_merger_list.{i}."
# table name (without "vision/") -> (HF tensor name, how our dims group into the HF tensor's;
# hf.py's layout convention, as qwen_vl.HF_NAMES).
HF_NAMES: dict[str, tuple[str, tuple[tuple[int, ...], ...]]] = {
    "patch_embed": (HF_ROOT + "patch_embed.proj.weight", ((4,), (0,), (1,), (2,), (3,))),
    "patch_bias": (HF_ROOT + "patch_embed.proj.bias", ((0,),)),
    "pos_embed": (HF_ROOT + "pos_embed.weight", ((0,), (1,))),
    "blocks/attn_norm": (_B + "norm1.weight", ((0,),)),
    "blocks/attn_norm_bias": (_B + "norm1.bias", ((0,),)),
    "blocks/wqkv": (_B + "attn.qkv.weight", ((1, 2, 3), (0,))),
    "blocks/bqkv": (_B + "attn.qkv.bias", ((0, 1, 2),)),
    "blocks/wo": (_B + "attn.proj.weight", ((2,), (0, 1))),
    "blocks/bo": (_B + "attn.proj.bias", ((0,),)),
    "blocks/mlp_norm": (_B + "norm2.weight", ((0,),)),
    "blocks/mlp_norm_bias": (_B + "norm2.bias", ((0,),)),
    "blocks/w_fc1": (_B + "mlp.linear_fc1.weight", ((1,), (0,))),
    "blocks/b_fc1": (_B + "mlp.linear_fc1.bias", ((0,),)),
    "blocks/w_fc2": (_B + "mlp.linear_fc2.weight", ((1,), (0,))),
    "blocks/b_fc2": (_B + "mlp.linear_fc2.bias", ((0,),)),
    "merger/norm": (HF_ROOT + "merger.norm.weight", ((0,),)),
    "merger/norm_bias": (HF_ROOT + "merger.norm.bias", ((0,),)),
    "merger/w1": (HF_ROOT + "merger.linear_fc1.weight", ((1,), (0,))),
    "merger/b1": (HF_ROOT + "merger.linear_fc1.bias", ((0,),)),
    "merger/w2": (HF_ROOT + "merger.linear_fc2.weight", ((1,), (0,))),
    "merger/b2": (HF_ROOT + "merger.linear_fc2.bias", ((0,),)),
    "deepstack/norm": (_D + "norm.weight", ((0,),)),
    "deepstack/norm_bias": (_D + "norm.bias", ((0,),)),
    "deepstack/w1": (_D + "linear_fc1.weight", ((1,), (0,))),
    "deepstack/b1": (_D + "linear_fc1.bias", ((0,),)),
    "deepstack/w2": (_D + "linear_fc2.weight", ((1,), (0,))),
    "deepstack/b2": (_D + "linear_fc2.bias", ((0,),)),
}


# ---------------------------------------------------------------- which patch sees which (host)

def position_taps(v: Qwen3VisionConfig, layout: qwen_vl.ImageLayout, grid):
    """HF's get_vision_interpolation_indices_and_weights (bilinear, align_corners, in merge-
    block order): ([P, 4] rows of the learned position table, [P, 4] float32 weights) that
    resample its square grid to each patch of an image of grid (t, h, w) [3] (traced) laid out
    as `layout`."""
    side = math.isqrt(v.num_position_embeddings)
    taps = []
    for at, size in zip(jnp.moveaxis(layout.positions, -1, 0), (grid[1], grid[2])):
        src = (at.astype(jnp.float32) * jnp.float32(side - 1)
               / jnp.maximum(size - 1, 1).astype(jnp.float32))
        raw = jnp.floor(src)[:, None] + jnp.arange(2, dtype=jnp.float32)
        taps.append((jnp.clip(raw, 0, side - 1).astype(jnp.int32),
                     jnp.clip(1 - jnp.abs(src[:, None] - raw), 0, None)))
    (ht, hw_), (wt, ww) = taps
    return ((ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4),
            (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4))


# ---------------------------------------------------------------- the tower (traced)

def _layer_norm(x, weight, bias, dtype):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + VISION_EPS)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)


def _block(v: Qwen3VisionConfig, p, x, cos, sin, rows, dtype):
    """One ViT block over all patches x [N, E], attending within each frame (`rows`)."""
    h = _layer_norm(x, p["attn_norm"], p["attn_norm_bias"], dtype)
    qkv = tower_lora.linear(p, "wqkv", "ne,eshd->nshd", h, dtype, 0) + p["bqkv"].astype(dtype)
    q, k, val = (qwen_vl.rotate(qkv[:, 0], cos, sin), qwen_vl.rotate(qkv[:, 1], cos, sin),
                 qkv[:, 2])
    attn = qwen_vl.attend(v, q, k, val, rows)
    x = x + tower_lora.linear(p, "wo", "nhd,hde->ne", attn, dtype, 1) + p["bo"].astype(dtype)
    h = _layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], dtype)
    up = tower_lora.linear(p, "w_fc1", "ne,ef->nf", h, dtype, 2) + p["b_fc1"].astype(dtype)
    down = tower_lora.linear(p, "w_fc2", "nf,fe->ne", _ACTS[v.hidden_act](up), dtype, 3)
    return x + down + p["b_fc2"].astype(dtype)


def _merge(p, h, dtype):
    """A merger's MLP over merged units h [n, U] (normed already): fc1, exact GELU, fc2."""
    h = jax.nn.gelu(tower_lora.linear(p, "w1", "nu,uv->nv", h, dtype, 0)
                    + p["b1"].astype(dtype), approximate=False)  # torch's nn.GELU()
    return tower_lora.linear(p, "w2", "nu,uo->no", h, dtype, 1) + p["b2"].astype(dtype)


def _part(params: dict, prefix: str) -> dict:
    return {k[len(prefix):]: a for k, a in params.items() if k.startswith(prefix)}


def vision_forward(v: Qwen3VisionConfig, params: dict, pixel_values, grid, dtype):
    """[P / merge_unit, O * (1 + K)]: the merger's features of one image's pixel_values
    [P, C*T*P*P] (its patches in the processor's order, padded to P) of grid (t, h, w) [3]
    (traced), then each DeepStack merger's, side by side, its own t*h*w / merge_unit first.
    params: the vision table's arrays by name, and the LoRA adapters when it has them."""
    P, u, E = pixel_values.shape[0], v.merge_unit, v.hidden_size
    layout = qwen_vl.image_layout(v, grid, P, windows=False)
    x = (pixel_values.astype(dtype) @ params["patch_embed"].astype(dtype).reshape(-1, E)
         + params["patch_bias"].astype(dtype))
    index, weight = position_taps(v, layout, grid)
    pos = params["pos_embed"].astype(dtype)[index]  # [P, 4, E]
    x = x + jnp.einsum("nte,nt->ne", pos, weight.astype(dtype))
    cos, sin = qwen_vl.vision_rope(v, layout.positions)
    blocks, deep = _part(params, "blocks/"), _part(params, "deepstack/")
    body = lambda x, p: (_block(v, p, x, cos, sin, layout.frame, dtype), None)  # noqa: E731
    out, first = [], 0
    # A scan over the blocks up to each DeepStack index, its merger after it.
    for j, stop in enumerate([*v.deepstack_visual_indexes, v.depth - 1]):
        if stop >= first:
            x, _ = jax.lax.scan(body, x, {k: a[first:stop + 1] for k, a in blocks.items()})
            first = stop + 1
        if j < v.deepstack_layers:
            p = {k: a[j] for k, a in deep.items()}
            h = _layer_norm(x.reshape(P // u, u * E), p["norm"], p["norm_bias"], dtype)
            out.append(_merge(p, h, dtype))
    merger = _part(params, "merger/")
    h = _layer_norm(x, merger["norm"], merger["norm_bias"], dtype).reshape(P // u, u * E)
    return jnp.concatenate([_merge(merger, h, dtype), *out], axis=-1)


class Qwen3Vision(qwen_vl.TowerParams):
    """Qwen3-VL's tower (qwen_vl.TowerParams): the blocks, the merger and the DeepStack
    mergers (stacked as the blocks)."""

    STACKED = {"blocks": True, "merger": False, "deepstack": True}

    def table(self):
        return param_table(self.cfg)

    def depths(self) -> dict[str, int]:
        return {"blocks": self.cfg.depth, "deepstack": self.cfg.deepstack_layers}

    def __call__(self, pixel_values, image_grid_thw, dtype):
        """([n, P / merge_unit, O * (1 + K)] (vision_forward per image), each image's own
        count [n]), as QwenVision's."""
        return qwen_vl.per_image(self.cfg, vision_forward, {**self.params(), **self.adapters()},
                                 pixel_values, image_grid_thw, dtype)
