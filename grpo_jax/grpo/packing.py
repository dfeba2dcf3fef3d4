"""Padding-free completions (numerics.padding_free): a group's short completions share a row.

A generation batch's completions are padded to its longest (shapes.completion_width), so where
one row runs long the others carry mostly padding through the update. With a shared prompt
(Decoder.shared_prefix) the completions of one group all continue the same prompt, so several
fit end to end in one row of the same width: each segment attends to the prompt's keys and to
its own earlier tokens only (attention.Mask's segments), at its own positions. Fewer rows run
the same real tokens; the log-probs are put back in [rows, C] order, so the loss and every
metric see the batch they would see padded (verl's remove-padding, for the grouped layout).

The plan is made on the host from the completion mask, per micro-batch (its rows stay its own:
the loss's per-micro-batch terms are unchanged), first-fit decreasing within each group; the
packed rows per micro-batch are rounded up to a quarter of its rows (and to the mesh's batch
divisor), so a run compiles a handful of programs. None where packing saves no row.
"""

from __future__ import annotations

import math

import numpy as np
from flax import struct

Array = np.ndarray


@struct.dataclass
class Packing:
    """Where each of a micro-batch's completion tokens sits in its packed rows. Leading axes
    are micro-batches x rows (packed rows M for the first four, the batch's rows N for
    `back`), so accumulate's micro-batch split cuts them as it cuts the batch."""

    slot: Array    # [k * M, C] int32: the token's flat index r * C + t in its micro-batch
    segment: Array  # [k * M, C] int32: its row r in the micro-batch; -1 on padding
    index: Array   # [k * M, C] int32: t, its index in its own row (0: a segment's first)
    prompt: Array  # [k * M] int32: the packed row's group in the micro-batch (r // group)
    back: Array    # [k * N, C] int32: where token (r, t) went, flat m * C + t' (0: padding)

    @property
    def rows(self) -> int:
        return self.prompt.shape[0]


def row_lengths(completion_mask: np.ndarray) -> np.ndarray:
    """Each row's length up to its last attended token (a tool result's masked-out tokens
    inside a completion travel with it)."""
    m = np.asarray(completion_mask) > 0
    C = m.shape[1]
    return np.where(m.any(1), C - np.argmax(m[:, ::-1], axis=1), 0)


def _bins(lengths: np.ndarray, width: int) -> list[list[int]]:
    """First-fit decreasing of rows with `lengths` into rows of `width` tokens."""
    bins: list[list[int]] = []
    room: list[int] = []
    for r in sorted(range(len(lengths)), key=lambda r: -int(lengths[r])):
        n = int(lengths[r])
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(r)
                room[b] -= n
                break
        else:
            bins.append([r])
            room.append(width - n)
    return bins


def _shifted(bins: list[list[int]], offset: int) -> list[list[int]]:
    return [[r + offset for r in b] for b in bins]


def plan(completion_mask: np.ndarray, micro_batches: int, group: int,
         divisor: int = 1) -> Packing | None:
    """The packing of a batch's completions ([N, C] mask) split into `micro_batches`
    micro-batches whose blocks of `group` consecutive rows share a prompt; packed rows per
    micro-batch a multiple of `divisor` (the mesh's batch axes). None when no micro-batch
    would run fewer rows."""
    mask = np.asarray(completion_mask)
    N, C = mask.shape
    rows = N // micro_batches
    if group < 2 or rows * micro_batches != N or rows % group:
        return None
    lengths = row_lengths(mask).reshape(micro_batches, rows)
    per_micro = [[bins for g in range(rows // group)
                  for bins in _shifted(_bins(lengths[j, g * group:(g + 1) * group], C), g * group)]
                 for j in range(micro_batches)]
    step = math.lcm(divisor, max(1, rows // 4))
    M = min(-(-max(len(b) for b in per_micro) // step) * step, rows)
    if M >= rows:
        return None
    slot = np.zeros((micro_batches, M, C), np.int32)
    segment = np.full((micro_batches, M, C), -1, np.int32)
    index = np.zeros((micro_batches, M, C), np.int32)
    prompt = np.zeros((micro_batches, M), np.int32)
    back = np.zeros((micro_batches, rows, C), np.int32)
    for j, bins in enumerate(per_micro):
        for m, members in enumerate(bins):
            prompt[j, m] = members[0] // group
            at = 0
            for r in members:
                n = int(lengths[j, r])
                t = np.arange(n)
                slot[j, m, at:at + n] = r * C + t
                segment[j, m, at:at + n] = r
                index[j, m, at:at + n] = t
                back[j, r, :n] = m * C + at + t
                at += n
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    return Packing(flat(slot), flat(segment), flat(index), flat(prompt), flat(back))
