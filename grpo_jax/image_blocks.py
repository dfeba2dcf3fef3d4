"""Prompt images in blocks, one block per prompt, for batches whose prompts hold different
numbers of images (0..K, each row its own list, as TRL 1.16 takes them).

Each prompt's images are padded to the batch's K with blank (zero) images, so that the
sampler's and the trainer's arrays keep a row's images with it ([rows, K, ...]) and a
micro-batch split by rows splits them too. The placeholder tokens decide where features go and
a blank image has none: Decoder.embed_multimodal's first_image (row b's first image, b * K)
starts each row's placeholders at its own block, so a blank's features are never placed and a
row sees what it would see in a batch of its own. Every image of a block gives the same number
of features: Gemma 3 resizes every image to one size; Qwen-VL's tower layout is static per set
of image sizes, so its blocks hold images of one size (data.image_buckets with one bucket).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from grpo_jax.errors import DataError

ONE_SIZE = ("Qwen-VL trains on images of one size (its tower is laid out per set of sizes); "
            "set data.image_buckets to one size (e.g. [448x448]), and have tools return "
            "images of that size")


def count(pixels: np.ndarray, grid: tuple | None) -> int:
    """Images per block: Gemma 3's pixels [rows, K, C, H, W]; Qwen-VL's [rows, K x patches,
    values] with its K grids."""
    return pixels.shape[1] if grid is None else len(grid)


def blocks(pixels: np.ndarray, grid: np.ndarray | None, counts: Sequence[int]
           ) -> tuple[np.ndarray, tuple | None]:
    """The image processor's output for the images of prompts holding `counts` images each
    (in prompt order: Gemma 3's pixels [images, C, H, W]; Qwen-VL's [patches, values] with
    its grids [images, 3]) as blocks of max(counts) images per prompt, blanks after a
    prompt's own. Qwen-VL's images must share one grid."""
    k = max(counts, default=0)
    per = 1
    one = None
    if grid is not None:
        sizes = {tuple(g) for g in np.asarray(grid, np.int64).tolist()}
        if len(sizes) > 1:
            raise DataError(f"the batch's images have patch grids {sorted(sizes)}: {ONE_SIZE}")
        one = sizes.pop() if sizes else None
        per = math.prod(one) if one else 0
    out = np.zeros((len(counts), k * per, *pixels.shape[1:]), pixels.dtype)
    at = 0
    for b, n in enumerate(counts):
        out[b, :n * per] = pixels[at:at + n * per]
        at += n * per
    if grid is None:
        return out, None
    return out, (one,) * k if one else ()


def widen(pixels: np.ndarray, grid: tuple | None, k: int, like: tuple | None = None
          ) -> tuple[np.ndarray, tuple | None]:
    """Blocks padded with blank images to k per prompt. Qwen-VL: the blanks take the grid of
    the blocks' images, or `like` (one image's grid) for blocks holding none."""
    have = count(pixels, grid)
    if k == have:
        return pixels, grid
    if grid is None:
        return np.pad(pixels, ((0, 0), (0, k - have)) + ((0, 0),) * (pixels.ndim - 2)), None
    one = tuple(grid[0]) if grid else like
    pad = ((0, 0), (0, (k - have) * math.prod(one)), (0, 0))
    return np.pad(pixels, pad), tuple(map(tuple, grid)) + (one,) * (k - have)


def common(parts: Sequence[tuple[np.ndarray, tuple | None]]
           ) -> list[tuple[np.ndarray, tuple | None]]:
    """Several batches' blocks (pixels, grid) padded to the most images per prompt among them,
    so that their rows stack; refused where their images differ in size."""
    shapes = {p.shape[2:] for p, _ in parts}
    grids = {tuple(g) for _, grid in parts if grid for g in grid}
    if len(shapes) > 1 or len(grids) > 1:
        raise DataError(f"prompts with images of shapes {sorted(shapes)} (grids "
                        f"{sorted(grids)}) meet in one batch: {ONE_SIZE}")
    k = max(count(*p) for p in parts)
    like = grids.pop() if grids else None
    return [widen(pixels, grid, k, like) for pixels, grid in parts]
