"""Qwen2.5-VL's vision side: the ViT that turns an image's patches into language-model
embeddings, and the 3-row (temporal, height, width) positions of M-RoPE (transformers'
modeling_qwen2_5_vl.py and vision_utils.py are the reference).

The tower: patches come flattened, as the HF image processor gives them ([N, C*T*P*P], each
image's patches grouped by spatial_merge_size x spatial_merge_size blocks); the Conv3d patch
embedding is a matmul over them. Blocks (RMSNorm, attention with a 2-D RoPE over each patch's
(h, w), SwiGLU MLP with biases) attend within windows of window_size pixels, except the
fullatt_block_indexes, which attend over their whole image; attention never crosses images.
The tower runs image by image (vmap), each image's patches padded to the batch's P, so images
of different sizes share one program: which patch sees which follows from the image's grid,
which the program takes as an array (image_layout computes the layout inside it). Each segment
(the image, or a window) is gathered into a padded row and attention runs per row, so its
memory grows with the segments' sizes. The patches stay in the processor's order throughout
(HF runs its blocks in window order: the same sets attend, only the order of a softmax's terms
differs), so the merger's output is in the placeholders' order.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import image_blocks
from grpo_jax.errors import ModelConfigError
from grpo_jax.models import tower_lora
from grpo_jax.models.tower_shape import TowerShape

MODEL_TYPE = "qwen2_5_vl"
# The vision tower's tensors live under this root of an HF directory (transformers 5 saves them
# there, as the hub's checkpoints have them); the language model's under "model.".
HF_ROOT = "visual."
VISION_EPS = 1e-6  # HF's vision RMSNorms have a fixed eps


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """The vision tower's static settings (HF's vision_config) and the placeholder token ids
    of the checkpoint's top-level config."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # in pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    tokens_per_second: int = 4  # videos only; kept for export
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @classmethod
    def from_hf(cls, hf: dict) -> "QwenVisionConfig":
        """From a Qwen2.5-VL config.json (its vision_config and top-level token ids)."""
        v = hf["vision_config"]
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"Qwen2.5-VL vision hidden_act {act!r}: only silu is supported")
        rope = v.get("rope_parameters") or {}
        ids = {k: hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id") if k in hf}
        return cls(depth=v["depth"], hidden_size=v["hidden_size"],
                   intermediate_size=v["intermediate_size"], num_heads=v["num_heads"],
                   out_hidden_size=v["out_hidden_size"], in_channels=v.get("in_channels", 3),
                   patch_size=v.get("patch_size", 14),
                   temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   window_size=v.get("window_size", 112),
                   fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   tokens_per_second=v.get("tokens_per_second", 4), **ids)

    # models/config.py's VisionConfig: the table, the HF names and config.json of its side.
    def param_table(self, text_hidden: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
        return param_table(self)  # its merger's width is out_hidden_size, the decoder's

    def hf_names(self) -> dict[str, tuple[str, tuple[tuple[int, ...], ...]]]:
        return HF_NAMES

    # Its checkpoints keep the tower under HF_ROOT and the decoder where a causal LM's is
    # (hf.py finds transformers 5's model.language_model. by the embeddings).
    hf_anchors = property(lambda self: {})
    deepstack_layers = 0  # no features added inside the decoder (Qwen3-VL's DeepStack)

    def hf_export_name(self, key: str) -> str:
        return key

    def tower(self) -> "QwenVision":
        return QwenVision(self)

    def image_grid(self, tokens: int) -> tuple[tuple[int, int, int], ...]:
        return image_grid(tokens, self.spatial_merge_size)

    def encoded(self, image_tokens: int, images: int | None = None):
        """A prompt's `image_tokens` merged tokens as `images` images (default one) of equal
        size, each gridded as image_grid grids its share (the images of a block share one
        size: image_blocks)."""
        images = images or 1
        if image_tokens % images:
            raise ModelConfigError(f"{image_tokens} image tokens in {images} images: Qwen2.5-VL's"
                                   " images of a prompt share one size; give a multiple")
        t, h, w = self.image_grid(image_tokens // images)[0]
        window = (self.window_size // self.patch_size) ** 2
        return TowerShape(images, t * h * w, self.hidden_size, self.intermediate_size,
                          self.num_heads, self.depth, len(self.fullatt_block_indexes), window,
                          (t * h * w, self.in_channels * self.temporal_patch_size
                           * self.patch_size ** 2))

    def to_hf(self, text_config: dict, tie_word_embeddings: bool) -> dict:
        """Qwen2.5-VL's config.json around the decoder's `text_config`: vision_config and
        the token ids at the top level."""
        text = {**text_config, "model_type": "qwen2_5_vl_text"}
        vision = dict(
            model_type="qwen2_5_vl_vision", depth=self.depth, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_heads=self.num_heads,
            out_hidden_size=self.out_hidden_size, in_channels=self.in_channels,
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            spatial_merge_size=self.spatial_merge_size, window_size=self.window_size,
            fullatt_block_indexes=list(self.fullatt_block_indexes), hidden_act="silu",
            tokens_per_second=self.tokens_per_second,
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
        """Patches merged into one language-model token."""
        return self.spatial_merge_size ** 2

    @property
    def patch_shape(self) -> tuple[int, int, int, int]:
        """(C, T, P, P): one flattened patch, in the processor's order."""
        return (self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)


def image_grid(tokens: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """One image of `tokens` merged tokens as the processor grids it: (1, h, w) patches,
    h x w = tokens x m^2, as square as `tokens` factors (1024 -> (1, 64, 64))."""
    side = max(d for d in range(1, int(tokens ** 0.5) + 1) if tokens % d == 0)
    return ((1, side * m, tokens // side * m),)


# name -> (shape, logical axes), under the decoder's "vision/" prefix. L blocks, E width, H heads,
# Dh head dim, F MLP width, U = E * merge_unit (a merged unit), O the language model's width.
def param_table(v: QwenVisionConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    L, E, H, Dh, F = v.depth, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size
    U, O = E * v.merge_unit, v.out_hidden_size
    return {
        "patch_embed": ((*v.patch_shape, E), (None, None, None, None, "embed")),
        "blocks/attn_norm": ((L, E), ("layers", "norm")),
        "blocks/wqkv": ((L, E, 3, H, Dh), ("layers", "embed", None, "heads", "head_dim")),
        "blocks/bqkv": ((L, 3, H, Dh), ("layers", None, "heads", "head_dim")),
        "blocks/wo": ((L, H, Dh, E), ("layers", "heads", "head_dim", "embed")),
        "blocks/bo": ((L, E), ("layers", None)),
        "blocks/mlp_norm": ((L, E), ("layers", "norm")),
        "blocks/w_gate": ((L, E, F), ("layers", "embed", "mlp")),
        "blocks/b_gate": ((L, F), ("layers", "mlp")),
        "blocks/w_up": ((L, E, F), ("layers", "embed", "mlp")),
        "blocks/b_up": ((L, F), ("layers", "mlp")),
        "blocks/w_down": ((L, F, E), ("layers", "mlp", "embed")),
        "blocks/b_down": ((L, E), ("layers", None)),
        "merger/norm": ((E,), ("norm",)),
        "merger/w1": ((U, U), ("embed", "mlp")),
        "merger/b1": ((U,), ("mlp",)),
        "merger/w2": ((U, O), ("mlp", "embed")),
        "merger/b2": ((O,), (None,)),
    }


_B = HF_ROOT + "blocks.{i}."
# table name (without "vision/") -> (HF tensor name, how our dims group into the HF tensor's,
# in HF order: hf.py's layout convention; torch Linear weights are [out, in]). The blocks'
# groups are those of one block (the stacked layer axis dropped).
HF_NAMES: dict[str, tuple[str, tuple[tuple[int, ...], ...]]] = {
    "patch_embed": (HF_ROOT + "patch_embed.proj.weight", ((4,), (0,), (1,), (2,), (3,))),
    "blocks/attn_norm": (_B + "norm1.weight", ((0,),)),
    "blocks/wqkv": (_B + "attn.qkv.weight", ((1, 2, 3), (0,))),
    "blocks/bqkv": (_B + "attn.qkv.bias", ((0, 1, 2),)),
    "blocks/wo": (_B + "attn.proj.weight", ((2,), (0, 1))),
    "blocks/bo": (_B + "attn.proj.bias", ((0,),)),
    "blocks/mlp_norm": (_B + "norm2.weight", ((0,),)),
    "blocks/w_gate": (_B + "mlp.gate_proj.weight", ((1,), (0,))),
    "blocks/b_gate": (_B + "mlp.gate_proj.bias", ((0,),)),
    "blocks/w_up": (_B + "mlp.up_proj.weight", ((1,), (0,))),
    "blocks/b_up": (_B + "mlp.up_proj.bias", ((0,),)),
    "blocks/w_down": (_B + "mlp.down_proj.weight", ((1,), (0,))),
    "blocks/b_down": (_B + "mlp.down_proj.bias", ((0,),)),
    "merger/norm": (HF_ROOT + "merger.ln_q.weight", ((0,),)),
    "merger/w1": (HF_ROOT + "merger.mlp.0.weight", ((1,), (0,))),
    "merger/b1": (HF_ROOT + "merger.mlp.0.bias", ((0,),)),
    "merger/w2": (HF_ROOT + "merger.mlp.2.weight", ((1,), (0,))),
    "merger/b2": (HF_ROOT + "merger.mlp.2.bias", ((0,),)),
}


# ---------------------------------------------------------------- which patch sees which

class Segments(NamedTuple):
    """Segments of an image's P patches padded into S rows of L slots: attention runs per row
    ([S, L, L] scores, not [P, P]). Traced: computed from the image's grid in the program."""

    index: jax.Array  # [S, L] the patch at each slot (padding: patch 0)
    valid: jax.Array  # [S, L] the slot holds a patch of the image (not padding)
    back: jax.Array  # [P] each patch's slot in the flattened [S * L] (padding patches: 0)


class ImageLayout(NamedTuple):
    """One image's patches (padded to P, the processor's order) as its grid lays them out."""

    positions: jax.Array  # [P, 2] each patch's (h, w) in its frame (HF's get_vision_position_ids)
    valid: jax.Array  # [P] a patch of the image, not padding
    frame: Segments  # the whole image in one row: the full-attention blocks'
    windows: Segments  # its windows (HF's get_vision_window_index), one per row: the others'


def window_side(v) -> int:
    """Merged units along a window's side."""
    return max(v.window_size // v.spatial_merge_size // v.patch_size, 1)


def window_rows(v, patches: int) -> int:
    """The most windows an image of at most `patches` patches (one frame) can have: the static
    row count of its window Segments, whatever its grid."""
    units, pw = patches // v.merge_unit, window_side(v)
    return max((-(-gh // pw) * -(-(units // gh) // pw) for gh in range(1, units + 1)),
               default=1)


def image_layout(v, grid, patches: int, windows: bool = True) -> ImageLayout:
    """The ImageLayout of an image whose grid (t, h, w) [3] int (traced) is laid out over
    `patches` slots (static; its own t * h * w first). Images are one frame (t = 1, as the
    image processor grids them). A blank image (grid 0, 0, 0) is all padding."""
    m, u = v.spatial_merge_size, v.merge_unit
    t, h, w = grid[0], grid[1], grid[2]
    i = jnp.arange(patches, dtype=jnp.int32)
    valid = i < t * h * w
    unit, r = i // u, i % u
    gw = jnp.maximum(w // m, 1)
    uh, uw = unit // gw, unit % gw  # the merged unit's row and column in the grid
    positions = jnp.stack([uh * m + r // m, uw * m + r % m], axis=-1)
    frame = Segments(i[None], valid[None], jnp.where(valid, i, 0))
    if not windows:
        return ImageLayout(positions, valid, frame, frame)
    # Each unit's slot in its window of pw x pw units (row-major), windows row-major over the
    # grid padded up to whole windows, as HF's get_window_index orders them.
    pw = window_side(v)
    nw = -(-gw // pw)
    slot = (((uh // pw) * nw + uw // pw) * pw * pw + (uh % pw) * pw + uw % pw) * u + r
    rows, width = window_rows(v, patches), pw * pw * u
    slot = jnp.where(valid, slot, rows * width)  # padding: dropped
    filled = jnp.full((rows * width,), -1, jnp.int32).at[slot].set(i, mode="drop")
    win = Segments(jnp.maximum(filled, 0).reshape(rows, width), (filled >= 0).reshape(rows, width),
                   jnp.where(valid, slot, 0))
    return ImageLayout(positions, valid, frame, win)


# ---------------------------------------------------------------- the tower (traced)

def _rms_norm(x, weight, dtype):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + VISION_EPS)
    return (y * weight.astype(jnp.float32)).astype(dtype)


def rotate(x, cos, sin):
    """HF's rotate-half RoPE on x [N, H, Dh] with cos, sin [N, Dh], in fp32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def vision_rope(v: QwenVisionConfig, positions):
    """(cos, sin) [N, Dh] of the ViT's 2-D RoPE: a quarter of head_dim's frequencies for h, a
    quarter for w, [h, w, h, w] across head_dim (rotate-half pairs i and i + Dh/2)."""
    half = v.head_dim // 2
    inv_freq = 1.0 / (v.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, Dh/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # [N, Dh/2]: h's, then w's
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def attend(v, q, k, val, rows: Segments):
    """Attention of q, k, val [N, H, Dh] within each segment of `rows`: gathered into [S, L]
    rows, so memory is S * L**2 per head, not N**2 (the batch's patches). Padding keys are
    masked out (every row has a real key, so no row is all -1e30); padding queries attend like
    the row's first patch and are dropped by the gather back."""
    index, valid = jnp.asarray(rows.index), jnp.asarray(rows.valid)
    q, k, val = q[index], k[index], val[index]  # [S, L, H, Dh]
    s = jnp.einsum("sqhd,skhd->shqk", q, k, preferred_element_type=jnp.float32)
    s = jnp.where(valid[:, None, None], s * v.head_dim ** -0.5, -1e30)
    probs = jax.nn.softmax(s, axis=-1).astype(val.dtype)
    out = jnp.einsum("shqk,skhd->sqhd", probs, val)
    return out.reshape(-1, *out.shape[2:])[jnp.asarray(rows.back)]


def _block(v: QwenVisionConfig, p, x, cos, sin, rows: Segments, dtype):
    """One ViT block over all patches x [N, E], attending within the segments `rows`."""
    h = _rms_norm(x, p["attn_norm"], dtype)
    qkv = tower_lora.linear(p, "wqkv", "ne,eshd->nshd", h, dtype, 0) + p["bqkv"].astype(dtype)
    q, k, val = rotate(qkv[:, 0], cos, sin), rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    attn = attend(v, q, k, val, rows)
    x = x + tower_lora.linear(p, "wo", "nhd,hde->ne", attn, dtype, 1) + p["bo"].astype(dtype)
    h = _rms_norm(x, p["mlp_norm"], dtype)
    gate = tower_lora.linear(p, "w_gate", "ne,ef->nf", h, dtype, 2) + p["b_gate"].astype(dtype)
    up = tower_lora.linear(p, "w_up", "ne,ef->nf", h, dtype, 3) + p["b_up"].astype(dtype)
    down = tower_lora.linear(p, "w_down", "nf,fe->ne", jax.nn.silu(gate) * up, dtype, 4)
    return x + down + p["b_down"].astype(dtype)


def vision_forward(v: QwenVisionConfig, params: dict, pixel_values, grid, dtype):
    """The image embeddings [P / merge_unit, out_hidden_size] of one image's pixel_values
    [P, C*T*P*P] (its patches in the processor's order, then padding up to P) whose grid
    (t, h, w) is `grid` [3] (traced), in that order: its own t*h*w / merge_unit first.
    params: the vision table's arrays by name (blocks stacked [depth, ...]), and the LoRA
    adapters of QwenVision.adapters when it has them. The patches stay in the processor's
    order: only attention depends on the order of its keys, and it gathers each window's."""
    P, u, E = pixel_values.shape[0], v.merge_unit, v.hidden_size
    layout = image_layout(v, grid, P)
    patch = params["patch_embed"].astype(dtype).reshape(-1, E)
    x = pixel_values.astype(dtype) @ patch  # the Conv3d: its kernel is the whole patch
    cos, sin = vision_rope(v, layout.positions)
    blocks = {k[len("blocks/"):]: a for k, a in params.items() if k.startswith("blocks/")}
    # Frames and windows pad to different [S, L], so one scan per run of same-kind blocks.
    for is_full, run in itertools.groupby(range(v.depth), v.fullatt_block_indexes.__contains__):
        run = list(run)
        rows = layout.frame if is_full else layout.windows
        body = lambda x, p, rows=rows: (_block(v, p, x, cos, sin, rows, dtype), None)  # noqa: E731
        x, _ = jax.lax.scan(body, x, {k: a[run[0]:run[-1] + 1] for k, a in blocks.items()})
    h = _rms_norm(x, params["merger/norm"], dtype).reshape(P // u, u * E)
    merger = {k[len("merger/"):]: a for k, a in params.items() if k.startswith("merger/")}
    h = jax.nn.gelu(tower_lora.linear(merger, "w1", "nu,uv->nv", h, dtype, 0)
                    + params["merger/b1"].astype(dtype),
                    approximate=False)  # torch's nn.GELU(): the exact erf form
    return (tower_lora.linear(merger, "w2", "nu,uo->no", h, dtype, 1)
            + params["merger/b2"].astype(dtype))


def per_image(v, forward, params: dict, pixel_values, image_grid_thw, dtype):
    """A Qwen-VL tower's forward over a batch of images, image by image:
    `forward(v, params, pixel_values [P, ...], grid [3], dtype)` (vision_forward) on
    pixel_values [n, P, ...], each image's patches padded to P (image_blocks), or the
    processor's [N, ...] (pad_patches: its grids then host arrays); image_grid_thw [n, 3].
    Returns (features [n, P / merge_unit, ...] each image's own first, how many are its own
    [n]: t*h*w / merge_unit), as ImageTower's __call__."""
    if pixel_values.ndim == 2:  # the processor's order: its grids read here (host arrays)
        pixel_values = pad_patches(pixel_values, image_grid_thw)
    grid = jnp.asarray(image_grid_thw, jnp.int32).reshape(-1, 3)
    index = jnp.arange(grid.shape[0], dtype=jnp.uint32)
    features = jax.vmap(lambda x, g, i: forward(v, _image_params(params, i), x, g, dtype))(
        pixel_values, grid, index)
    return features, grid[:, 0] * grid[:, 1] * grid[:, 2] // v.merge_unit


def pad_patches(pixel_values, image_grid_thw):
    """The processor's pixel_values [N, values] (its images' patches one after another) as
    [n, P, values], each image's patches padded with zeros to the largest's, P; the grids
    [n, 3] are read on the host."""
    index, valid = image_blocks.patch_rows(image_grid_thw)
    pixel_values = jnp.asarray(pixel_values)
    return jnp.where(jnp.asarray(valid)[..., None], pixel_values[jnp.asarray(index)], 0)


def _image_params(params: dict, image) -> dict:
    """The tower's params for image `image` (traced) of a batch: LoRA dropout keys folded
    with it, so that images draw masks of their own as one sequence of all their patches
    would (under vmap the same key would give every image the same mask)."""
    def fold(key):
        stacked = key.ndim > (0 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 1)
        if stacked:  # a key per layer
            return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, image)
        return jax.random.fold_in(key, image)
    return {k: fold(a) if k.endswith("lora_dropout_key") else a for k, a in params.items()}


class _Holder(nnx.Module):
    """Holder for a group of parameters (the stacked blocks, a merger)."""


class TowerParams(nnx.Module):
    """A Qwen-VL tower's parameters, by holder: set by the Decoder from the vision table
    (vision/blocks/..., vision/merger/..., vision/patch_embed), the LoRA adapters models/lora.py
    gave its linears (`<holder>.<w>_lora_a|b`, stacked as the holder's weights; an unstacked
    holder's are a stack of one) and a quantized base's scales (`<w>_qscale` beside each
    weight, models/quant.py). A tower names its holders (STACKED), their stack depths and its
    table."""

    # Set by models/lora.py (add_adapters, with_dropout) with adapters: as the Decoder's.
    lora_scale: float | None = None
    lora_dropout: float = 0.0
    lora_dropout_key: jax.Array | None = None
    # holder -> whether its weights are stacked (a leading layer axis)
    STACKED = {"blocks": True, "merger": False}

    def __init__(self, cfg):
        self.cfg = cfg
        for part in self.STACKED:
            setattr(self, part, _Holder())

    def table(self):
        """The tower's parameter names (its param_table)."""
        raise NotImplementedError

    def depths(self) -> dict[str, int]:
        """Each stacked holder's depth."""
        raise NotImplementedError

    def params(self) -> dict[str, jax.Array]:
        out = {}
        for name in self.table():
            node = self
            for part in name.split("/"):
                node = getattr(node, part)
            out[name] = node[...]
        for part in self.STACKED:
            out |= {f"{part}/{name}": var[...] for name, var in vars(getattr(self, part)).items()
                    if name.endswith("_qscale")}  # a quantized base's (models/quant.py)
        return out

    def adapters(self) -> dict[str, jax.Array]:
        """The adapters by table name ({blocks/<w>_lora_a: A, ..._lora_b: scale B,
        merger/...} an unstacked holder's without their stack of one) and under with_dropout
        a dropout key and rate per layer of a stacked holder and one for an unstacked one; {}
        without adapters. B is scaled here, once per forward, as the decoder's
        (lora.layer_extras)."""
        if self.lora_scale is None:
            return {}
        out = {}
        for part, stacked in self.STACKED.items():
            for name, var in vars(getattr(self, part)).items():
                if "_lora_" in name:
                    a = var[...] * self.lora_scale if name.endswith("_lora_b") else var[...]
                    out[f"{part}/{name}"] = a if stacked else a[0]
        if self.lora_dropout_key is not None:
            key, rate = self.lora_dropout_key, self.lora_dropout
            for i, part in enumerate(self.STACKED):  # a key of its own for each holder
                part_key = jax.random.fold_in(key, i)
                if self.STACKED[part]:
                    n = self.depths()[part]
                    out[f"{part}/lora_dropout_key"] = jax.random.split(part_key, n)
                    out[f"{part}/lora_dropout_rate"] = jnp.full((n,), rate, jnp.float32)
                else:
                    out[f"{part}/lora_dropout_key"] = part_key
                    out[f"{part}/lora_dropout_rate"] = jnp.asarray(rate, jnp.float32)
        return out


class QwenVision(TowerParams):
    """Qwen2.5-VL's tower (TowerParams: blocks and merger)."""

    def table(self):
        return param_table(self.cfg)

    def depths(self) -> dict[str, int]:
        return {"blocks": self.cfg.depth}

    def __call__(self, pixel_values, image_grid_thw, dtype):
        """(Image embeddings [n, P / merge_unit, out_hidden_size], how many of each image's
        are its own [n]) of pixel_values [n, P, C*T*P*P] (each image's patches padded to P)
        whose grids are image_grid_thw [n, 3] (traced: one program for any grids of P
        patches at most)."""
        return per_image(self.cfg, vision_forward, {**self.params(), **self.adapters()},
                         pixel_values, image_grid_thw, dtype)


# ---------------------------------------------------------------- M-RoPE positions (host)

def rope_index(v: QwenVisionConfig, tokens, attention_mask, image_grid_thw):
    """HF's get_rope_index for images: (positions [3, B, T] int32, deltas [B] int32). Over each
    row's real tokens (attention_mask 1; padding gets 0): text counts up on all three rows; a
    run of image placeholders (the next image of image_grid_thw [n, 3], in batch order, or of
    its row's, image_grid_thw [B', K, 3] each row's grids, blanks (0, 0, 0) skipped) gets
    (t, h, w) of its merged grid, each offset by the position it starts at, and the text after
    it continues from that start + max(h, w). deltas: the next position minus the row's real
    length, what a decode step adds to the text position (real tokens so far)."""
    tokens, mask = np.asarray(tokens), np.asarray(attention_mask).astype(bool)
    m = v.spatial_merge_size
    given = np.asarray(image_grid_thw, np.int64)
    grids = iter(given.reshape(-1, 3).tolist())
    B, T = tokens.shape
    positions, deltas = np.zeros((3, B, T), np.int32), np.zeros(B, np.int32)
    for b in range(B):
        if given.ndim == 3:  # the row's own images
            grids = iter([g for g in given[b].tolist() if any(g)] if b < len(given) else [])
        ids = tokens[b][mask[b]]
        parts, at = [], 0
        for is_image, run in itertools.groupby(ids == v.image_token_id):
            n = len(list(run))
            if not is_image:
                parts.append(np.broadcast_to(np.arange(n) + at, (3, n)))
                at += n
                continue
            t, h, w = next(grids)
            h, w = h // m, w // m
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                        indexing="ij")).reshape(3, -1)
            if grid.shape[1] != n:
                raise ValueError(f"row {b}: {n} image placeholders, its grid {(t, h * m, w * m)}"
                                 f" merges to {grid.shape[1]}")
            parts.append(grid + at)
            at += max(h, w)
        row = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
        positions[:, b, mask[b]] = row
        deltas[b] = (row.max() + 1 if row.size else 0) - len(ids)
    return positions, deltas


def row_positions(v: QwenVisionConfig, prompt_ids, prompt_mask, image_grid, completion_width: int,
                  pad_id: int, completion_images=None) -> np.ndarray:
    """M-RoPE positions [N, 3, P + C] int32 of rows (RolloutBatch.positions) whose prompts'
    image placeholders are their images' (each row's images of `image_grid` [N, K, 3], its
    grids, blanks (0, 0, 0)): rope_index over prompt + completion, as transformers' forward over
    the whole row computes it. The completion's text continues from the prompt's next position
    on all three rows, and its image placeholders (completion_images [N, C] bool: a tool
    result's images; None: none) take their images' grid positions."""
    n = len(prompt_ids)
    completion = np.full((n, completion_width), pad_id, np.int64)
    if completion_images is not None:
        completion[np.asarray(completion_images, bool)] = v.image_token_id
    ids = np.concatenate([np.asarray(prompt_ids), completion], axis=1)
    mask = np.concatenate([np.asarray(prompt_mask), np.ones((n, completion_width), np.int32)],
                          axis=1)
    positions, _ = rope_index(v, ids, mask, np.asarray(image_grid).reshape(n, -1, 3))
    return positions.transpose(1, 0, 2).astype(np.int32)
