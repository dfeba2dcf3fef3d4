"""Prompt images in blocks, one block per prompt, for batches whose prompts hold different
numbers of images (0..K, each row its own list, as TRL 1.16 takes them) of different sizes.

Each prompt's images are padded to the batch's K with blank images, so that the sampler's and
the trainer's arrays keep a row's images with it ([rows, K, ...]) and a micro-batch split by
rows splits them too. The placeholder tokens decide where features go and a blank image has
none: Decoder.embed_multimodal's first_image (row b's first image, b * K) starts each row's
placeholders at its own block's features, so a blank's are never placed and a row sees what it
would see in a batch of its own.

Gemma 3 resizes every image to one size: its blocks are [rows, K, C, H, W]. Qwen-VL's images
come in many sizes: each image's patch rows are padded to the batch's most, P, making blocks
[rows, K, P, C*T*P*P] with the grids [rows, K, 3] (t, h, w) beside them, (0, 0, 0) for a blank.
The tower runs image by image and reads each grid as an array, so a batch of any sizes runs
one program per (K, P); image_buckets bounds how many P a run meets.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grpo_jax.errors import DataError


def count(pixels: np.ndarray) -> int:
    """Images per block (K): Gemma 3's pixels [rows, K, C, H, W], Qwen-VL's [rows, K, P,
    values]."""
    return pixels.shape[1]


def blocks(pixels: np.ndarray, grid: np.ndarray | None, counts: Sequence[int]
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """The image processor's output for the images of prompts holding `counts` images each
    (in prompt order: Gemma 3's pixels [images, C, H, W]; Qwen-VL's [patches, values] with
    its grids [images, 3]) as blocks of max(counts) images per prompt, blanks after a
    prompt's own; Qwen-VL's images' patch rows padded to the most of them."""
    k = max(counts, default=0)
    if grid is None:
        out = np.zeros((len(counts), k, *pixels.shape[1:]), pixels.dtype)
        at = 0
        for b, n in enumerate(counts):
            out[b, :n] = pixels[at:at + n]
            at += n
        return out, None
    grid = np.asarray(grid, np.int64).reshape(-1, 3)
    if (grid[:, 0] != 1).any():
        raise DataError(f"images of {sorted(set(grid[:, 0].tolist()))} frames: Qwen-VL trains "
                        "on still images (one frame each), not videos")
    index, valid = patch_rows(grid)
    padded = np.where(valid[..., None], pixels[index], 0).astype(pixels.dtype)  # [n, P, V]
    out = np.zeros((len(counts), k, *padded.shape[1:]), pixels.dtype)
    grids = np.zeros((len(counts), k, 3), np.int32)
    at = 0
    for b, n in enumerate(counts):
        out[b, :n], grids[b, :n] = padded[at:at + n], grid[at:at + n]
        at += n
    return out, grids


def patch_rows(grid) -> tuple[np.ndarray, np.ndarray]:
    """(index [n, P], valid [n, P]): where each image's patch rows sit in the processor's
    pixel_values (its images' patches one after another), for images of grids [n, 3] padded
    to the largest's P patches (index 0 where not valid)."""
    sizes = np.asarray(grid, np.int64).reshape(-1, 3).prod(axis=1)
    at = np.arange(int(sizes.max(initial=0)))
    valid = at[None] < sizes[:, None]
    return np.where(valid, (np.cumsum(sizes) - sizes)[:, None] + at[None], 0), valid


def widen(pixels: np.ndarray, grid: np.ndarray | None, k: int, patches: int | None = None
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """Blocks padded with blank images to k per prompt (and Qwen-VL's images' patch rows to
    `patches`, where given)."""
    pad = [(0, 0)] * pixels.ndim
    pad[1] = (0, k - pixels.shape[1])
    if grid is None:
        return np.pad(pixels, pad), None
    if patches is not None:
        pad[2] = (0, patches - pixels.shape[2])
    return np.pad(pixels, pad), np.pad(np.asarray(grid), ((0, 0), (0, k - grid.shape[1]),
                                                          (0, 0)))


def common(parts: Sequence[tuple[np.ndarray, np.ndarray | None]]
           ) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Several batches' blocks (pixels, grid) padded to the most images per prompt among them
    (and Qwen-VL's to the most patches per image), so that their rows stack."""
    k = max(count(p) for p, _ in parts)
    if parts[0][1] is None:  # Gemma 3: one image size
        shapes = {p.shape[2:] for p, _ in parts}
        if len(shapes) > 1:
            raise DataError(f"prompts with images of shapes {sorted(shapes)} meet in one batch: "
                            "give every image the processor's one size")
        return [widen(pixels, None, k) for pixels, _ in parts]
    patches = max(p.shape[2] for p, _ in parts)
    return [widen(pixels, grid, k, patches) for pixels, grid in parts]

