"""gpt-oss's MXFP4 expert weights, dequantized as they are read (transformers'
convert_moe_packed_tensors, one block at a time).

A checkpoint stores each expert tensor T [E, in, out] (transformers' bf16 layout) as
`<name>_blocks` [E, out, in / 32, 16] uint8 (two FP4 e2m1 codes a byte, the low nibble first)
and `<name>_scales` [E, out, in / 32] uint8 (a power of two per 32 inputs, biased by 127). Every
value is exactly representable in bf16 and fp32, so the dequantized weights are the checkpoint's.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8 and scales [..., G] -> [..., G * 32] fp32."""
    out = np.empty((*blocks.shape[:-1], 32), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


class Mxfp4Tensor:
    """The dequantized T [E, in, out] of memory-mapped `_blocks` and `_scales` slices
    (safetensors' get_slice), read like one: get_shape() and T[e, in, out] with slices (the
    `out` slice may have a step). Only the experts and outputs asked for are read, each
    expert's whole `in` range (a row of blocks); one expert is dequantized at a time."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales
        E, out, groups, size = blocks.get_shape()
        self.shape = [E, groups * size * 2, out]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        experts, inputs, outputs = index
        rows = []
        for e in range(*experts.indices(self.shape[0])):
            blocks = self.blocks[e:e + 1, outputs]
            scales = self.scales[e:e + 1, outputs]
            w = dequantize(np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8))
            rows.append(w[0].T[inputs])  # [out, in] -> [in, out], then our inputs
        return np.stack(rows)
