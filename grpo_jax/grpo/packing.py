"""Padding-free completions (numerics.padding_free): short completions share a row.

A generation batch's completions are padded to its longest (shapes.completion_width), so where
one row runs long the others carry mostly padding through the update. With a shared prompt
(Decoder.shared_prefix) each prompt runs once and its completions attend to its keys, so
completions fit end to end in a row of the same width: each segment attends to its own
prompt's keys and to its own earlier tokens only (attention.Mask's segments), at its own
positions. A packed row holds the prompts of up to K groups (its `prompt` slots), so the
completions of different prompts share a row too. Fewer rows run the same real tokens; the
log-probs are put back in [rows, C] order, so the loss and every metric see the batch they
would see padded (verl's remove-padding, for the grouped layout).

The plan is made on the host from the completion mask, per micro-batch (its rows stay its own:
the loss's per-micro-batch terms are unchanged): first-fit decreasing with at most K groups a
row, K the smallest of 1, 2, 4, 8 that reaches the fewest rows (each prompt slot adds its keys
to every packed row's attention); the packed rows per micro-batch are rounded up to an eighth
of its rows (and to the mesh's batch divisor), so a run compiles a handful of programs. None
where packing saves no row.
"""

from __future__ import annotations

import math

import numpy as np
from flax import struct

Array = np.ndarray


@struct.dataclass
class Packing:
    """Where each of a micro-batch's completion tokens sits in its packed rows. Leading axes
    are micro-batches x rows (packed rows M for the first three, the batch's rows N for
    `back`), so accumulate's micro-batch split cuts them as it cuts the batch."""

    slot: Array    # [k * M, C] int32: the token's flat index r * C + t in its micro-batch
    segment: Array  # [k * M, C] int32: its row r in the micro-batch; -1 on padding
    prompt: Array  # [k * M, K] int32: the groups (r // group) whose prompts the row holds
    #                 (-1: an unused slot); a segment attends to its own group's slot
    back: Array    # [k * N, C] int32: where token (r, t) went, flat m * C + t' (0: padding)

    @property
    def rows(self) -> int:
        return self.prompt.shape[0]


def packable(batch) -> bool:
    """Whether a batch's completions can run packed: plain text (no images, no M-RoPE
    positions) without a routing record (its experts are per unpacked token)."""
    return all(x is None for x in (batch.completion_routing, batch.pixel_values,
                                   batch.positions))


def row_lengths(completion_mask: np.ndarray) -> np.ndarray:
    """Each row's length up to its last attended token (a tool result's masked-out tokens
    inside a completion travel with it)."""
    m = np.asarray(completion_mask) > 0
    C = m.shape[1]
    return np.where(m.any(1), C - np.argmax(m[:, ::-1], axis=1), 0)


def _bins(lengths: np.ndarray, width: int, group: int, most: int) -> list[list[int]]:
    """First-fit decreasing of the rows with `lengths` (empty ones left out: nothing to run)
    into rows of `width` tokens holding at most `most` groups (row r's is r // group)."""
    bins: list[list[int]] = []
    room: list[int] = []
    held: list[set] = []
    for r in sorted(np.flatnonzero(lengths), key=lambda r: -int(lengths[r])):
        n, g = int(lengths[r]), int(r) // group
        for b, left in enumerate(room):
            if n <= left and (g in held[b] or len(held[b]) < most):
                bins[b].append(int(r))
                room[b] -= n
                held[b].add(g)
                break
        else:
            bins.append([int(r)])
            room.append(width - n)
            held.append({g})
    return bins


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
    step = math.lcm(divisor, max(1, rows // 8))
    fewest = None  # (packed rows, bins per micro-batch)
    for most in (1, 2, 4, 8):
        per_micro = [_bins(lengths[j], C, group, most) for j in range(micro_batches)]
        M = max(step, -(-max(map(len, per_micro)) // step) * step)
        if fewest is None or M < fewest[0]:
            fewest = (M, per_micro)
        if most >= rows // group:
            break
    M, per_micro = fewest
    if M >= rows:
        return None
    # Slots a power of two (fewer programs), unused ones masked out.
    K = 1 << (max((len({r // group for r in b}) for bins in per_micro for b in bins),
                  default=1) - 1).bit_length()
    slot = np.zeros((micro_batches, M, C), np.int32)
    segment = np.full((micro_batches, M, C), -1, np.int32)
    prompt = np.full((micro_batches, M, K), -1, np.int32)
    prompt[:, :, 0] = 0  # a row with no segment still attends to some prompt
    back = np.zeros((micro_batches, rows, C), np.int32)
    for j, bins in enumerate(per_micro):
        for m, members in enumerate(bins):
            groups = sorted({r // group for r in members})
            prompt[j, m, :len(groups)] = groups
            at = 0
            for r in members:
                n = int(lengths[j, r])
                t = np.arange(n)
                slot[j, m, at:at + n] = r * C + t
                segment[j, m, at:at + n] = r
                back[j, r, :n] = m * C + at + t
                at += n
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    return Packing(flat(slot), flat(segment), flat(prompt), flat(back))
