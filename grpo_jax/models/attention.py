"""Attention at long lengths: masks described by indices instead of [T, S] arrays, a blockwise
(flash) attention in plain JAX, context parallelism over the mesh's `context` axis, and Pallas
splash attention on TPU.

At 32k tokens a [T, S] score matrix per row and head is 4 GB in fp32, and so is a [B, T, S]
boolean mask per 32 rows: neither is ever built here. `Mask` says which keys a query sees from
its index and each key's; `flash` walks key blocks with an online softmax (the scores of one
[query block, key block] pair at a time) and skips the pairs the mask hides entirely, forward
and backward (a custom VJP that recomputes the scores instead of storing them).

Context parallelism (MaxText's default strategy): the queries of a row are split over the
`context` axis by position and every device attends over all the row's keys and values,
gathered once per layer (their gradients reduce-scattered back). Under a causal mask the last
positions see the most keys, so positions are dealt to devices zig-zag (`zigzag_order`: device
i holds chunks i and 2 cp - 1 - i of 2 cp): every device then does the same causal work.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import mesh as mesh_lib

NEG = -1e30  # masked scores: a finite floor (not -inf) keeps fully masked rows free of NaN


class Mask(NamedTuple):
    """Which keys each query sees, without a [T, S] array. Keys are in sequence order (key s
    is at index s); query t is at index q_idx[t] (a shared prompt's completions: P + t). Query
    t sees key s when key_ok[b, s], s <= q_idx[t] (causal) and q_idx[t] - s < window.
    `blocks` [B, S] int (Gemma 3's images; None: none): a query also sees the later keys of
    its own block (blocks >= 0, an image's tokens), the window still bounding it from below
    (transformers' AND(window, OR(causal, blockwise))). `segments` (padding-free packed
    completions, grpo/packing.py; None: none): the triple ([B, T] each query's own segment,
    [B, T] the segment it shares (its prompt's), [B, S] each key's); a query then sees only
    the keys of those two. Only the dense mask has blocks and segments (the blockwise kernels
    skip key blocks after the queries)."""

    q_idx: Any      # [T] int32 (numpy or traced)
    key_ok: Any     # [B, S] bool
    window: Any = None  # None (no window), an int, or a traced int32 (layers of both kinds)
    blocks: Any = None  # [B, S] int32, -1 outside the blocks
    segments: Any = None  # ([B, T], [B, T], [B, S]) int32

    def dense(self) -> jax.Array:
        """[B, T, S] bool, for the plain attention."""
        q = jnp.asarray(self.q_idx)[:, None]
        s = jnp.arange(self.key_ok.shape[1])[None, :]
        seen = (s <= q)[None]
        if self.blocks is not None:
            own = jnp.take(self.blocks, q[:, 0], axis=1)[:, :, None]  # [B, T, 1]
            seen = seen | ((own == self.blocks[:, None, :]) & (own >= 0))
        if self.window is not None:
            seen = seen & (q - s < self.window)[None]
        if self.segments is not None:
            own, shared, keys = (jnp.asarray(x)[:, :, None] for x in self.segments)
            keys = keys.transpose(0, 2, 1)  # [B, 1, S]
            seen = seen & ((keys == own) | (keys == shared))
        return seen & self.key_ok[:, None, :]


def zigzag_order(length: int, shards: int) -> np.ndarray | None:
    """Sequence positions in the order that deals them to `shards` devices zig-zag: the
    sequence cut into 2 * shards chunks, device i holding chunks i and 2 * shards - 1 - i, so
    each device's causal work is the same. None (natural order) for one shard, or where the
    length does not split into 2 * shards chunks."""
    if shards <= 1 or length % (2 * shards):
        return None
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                           for i in range(shards)])


def inverse(order: np.ndarray | None) -> np.ndarray | None:
    return None if order is None else np.argsort(order)


def softcap(x, cap: float | None):
    """Gemma 2's soft-capping: cap * tanh(x / cap) (identity for None)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


# ------------------------------------------------------------------ blockwise (flash) attention

def flash(q, k, v, mask: Mask, scale: float, cap: float | None = None, block: int = 512):
    """Grouped-query attention of q [B, T, H, Dh] over k, v [B, K, S, Dh] (the KV cache's
    layout), `block` queries and keys at a time with an online softmax: the plain attention's
    values with `mask.dense()` at every query that sees a key. (A query that sees none, left
    padding, averages the values of the blocks it visits where the plain one averages them all:
    finite either way, and read by nothing.) Memory is linear in T and S. Returns
    [B, T, H, Dh] in q's dtype."""
    B, T, H, Dh = q.shape
    K, S = k.shape[1], k.shape[2]
    bq, bk = min(block, T), min(block, S)
    tq, ts = -(-T // bq) * bq, -(-S // bk) * bk
    q_idx = jnp.asarray(mask.q_idx, jnp.int32)
    # Padded queries copy the last query's index (they see what it sees: never an empty row);
    # padded keys are never real.
    q_idx = jnp.concatenate([q_idx, jnp.broadcast_to(q_idx[-1:], (tq - T,))])
    key_ok = jnp.pad(mask.key_ok.astype(bool), ((0, 0), (0, ts - S)))
    qg = q.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, Dh]
    qg = jnp.pad(qg, ((0, 0),) * 3 + ((0, tq - T), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, ts - S), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, ts - S), (0, 0)))
    window = (jnp.asarray(2 ** 30 if mask.window is None else mask.window, jnp.int32))
    # Tied to the queries: inside a scan over layers the masks would otherwise be loop-invariant,
    # and JAX's partial evaluation would compute every block pair's mask ahead of the loop and
    # keep them all ([nq, nk, ..., bq, bk]: memory quadratic in length; seen on an H200).
    qg, q_idx, key_ok, window = jax.lax.optimization_barrier((qg, q_idx, key_ok, window))
    out = _flash(qg, k, v, q_idx, key_ok, window, scale, cap, bq, bk)
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _visible(q_idx, k_lo, bk, window):
    """Whether a [query block, key block] pair may hold a seen key: some key at or before some
    query, and within the window of some query. The block's keys are k_lo .. k_lo + bk - 1."""
    return (k_lo <= jnp.max(q_idx)) & (jnp.min(q_idx) - (k_lo + bk - 1) < window)


def _scores(qb, kb, q_idx, k_lo, ok, window, scale, cap):
    """(raw scores, capped scores with masked ones at NEG, seen) of one block pair: qb
    [B, K, G, bq, Dh], kb [B, K, bk, Dh], ok [B, bk]."""
    raw = jnp.einsum("bkgqd,bksd->bkgqs", qb, kb.astype(qb.dtype),
                     preferred_element_type=jnp.float32) * scale
    s_idx = k_lo + jnp.arange(kb.shape[2])
    seen = ((s_idx[None, :] <= q_idx[:, None]) & (q_idx[:, None] - s_idx[None, :] < window))
    seen = seen[None] & ok[:, None, :]  # [B, bq, bk]
    return raw, jnp.where(seen[:, None, None], softcap(raw, cap), NEG), seen[:, None, None]


def _blocks(x, n, axis):
    """x with `axis` cut into n blocks, the block index moved to the front."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _forward(q, k, v, q_idx, key_ok, window, scale, cap, bq, bk):
    """(out [B, K, G, T, Dh] fp32, logsumexp [B, K, G, T] fp32)."""
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    ks, vs = _blocks(k, nk, 2), _blocks(v, nk, 2)
    oks = _blocks(key_ok, nk, 1)

    def q_block(xs):
        qb, qi = xs

        def step(carry, ys):
            kb, vb, okb, j = ys

            def visit(carry):
                o, m, l = carry
                _, s, _ = _scores(qb, kb, qi, j * bk, okb, window, scale, cap)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                o = o * corr[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb,
                                                     preferred_element_type=jnp.float32)
                return o, m_new, l * corr + p.sum(-1)
            return jax.lax.cond(_visible(qi, j * bk, bk, window), visit, lambda c: c, carry), None

        B, K, G, _, Dh = qb.shape
        init = (jnp.zeros((B, K, G, bq, Dh), jnp.float32),
                jnp.full((B, K, G, bq), -jnp.inf, jnp.float32),
                jnp.zeros((B, K, G, bq), jnp.float32))
        (o, m, l), _ = jax.lax.scan(step, init, (ks, vs, oks, jnp.arange(nk)))
        l = jnp.maximum(l, 1e-30)  # every query sees its own index: l >= 1 in practice
        return o / l[..., None], m + jnp.log(l)

    o, lse = jax.lax.map(q_block, (_blocks(q, nq, 3), q_idx.reshape(nq, bq)))
    return jnp.moveaxis(o, 0, 3).reshape(q.shape), jnp.moveaxis(lse, 0, 3).reshape(q.shape[:4])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, q_idx, key_ok, window, scale, cap, bq, bk):
    return _forward(q, k, v, q_idx, key_ok, window, scale, cap, bq, bk)[0].astype(q.dtype)


def _flash_fwd(q, k, v, q_idx, key_ok, window, scale, cap, bq, bk):
    o, lse = _forward(q, k, v, q_idx, key_ok, window, scale, cap, bq, bk)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_idx, key_ok, window, o, lse)


def _flash_bwd(scale, cap, bq, bk, res, do):
    """FlashAttention-2's backward: the scores of each block pair recomputed from the saved
    logsumexp; dq accumulated per query block, dk and dv summed over query blocks."""
    q, k, v, q_idx, key_ok, window, o, lse = res
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)  # [B, K, G, T]
    ks, vs, oks = _blocks(k, nk, 2), _blocks(v, nk, 2), _blocks(key_ok, nk, 1)

    def q_block(acc, xs):
        qb, qi, dob, lb, db = xs

        def step(dq, ys):
            kb, vb, okb, j = ys

            def visit(dq):
                raw, s, seen = _scores(qb, kb, qi, j * bk, okb, window, scale, cap)
                p = jnp.exp(s - lb[..., None])
                dv = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dob.dtype), dob,
                                preferred_element_type=jnp.float32)
                dp = jnp.einsum("bkgqd,bksd->bkgqs", dob, vb.astype(dob.dtype),
                                preferred_element_type=jnp.float32)
                ds = jnp.where(seen, p * (dp - db[..., None]), 0.0)
                if cap is not None:
                    ds = ds * (1 - jnp.tanh(raw / cap) ** 2)
                ds = ds * scale
                dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(qb.dtype),
                                     kb.astype(qb.dtype), preferred_element_type=jnp.float32)
                dk = jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qb.dtype), qb,
                                preferred_element_type=jnp.float32)
                return dq, (dk, dv)

            def skip(dq):
                zero = jnp.zeros(kb.shape, jnp.float32)
                return dq, (zero, zero)
            return jax.lax.cond(_visible(qi, j * bk, bk, window), visit, skip, dq)

        dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qb.shape, jnp.float32),
                                    (ks, vs, oks, jnp.arange(nk)))
        return (acc[0] + dk, acc[1] + dv), dq

    zeros = jnp.zeros((nk, *ks.shape[1:]), jnp.float32)
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), (
        _blocks(q, nq, 3), q_idx.reshape(nq, bq), _blocks(do, nq, 3),
        _blocks(lse, nq, 3), _blocks(delta, nq, 3)))
    unblock = lambda x, axis: jnp.moveaxis(x, 0, axis).reshape(  # noqa: E731
        x.shape[1:axis + 1] + (-1,) + x.shape[axis + 2:])
    return (unblock(dq, 3).astype(q.dtype), unblock(dk, 2).astype(k.dtype),
            unblock(dv, 2).astype(v.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------ context parallelism

def gather_keys(x, order, mesh):
    """Keys or values [B, S, K, Dh] (or a key mask [B, S]) computed from positions in `order`
    (split over the context axis) as every device of the row needs them: whole (one all-gather
    over `context`; its transpose reduce-scatters the gradient) and in sequence order."""
    if mesh is not None and mesh_lib.context_size(mesh) > 1:
        names = ("batch", None, "kv_heads", None)[:x.ndim]
        x = jax.lax.with_sharding_constraint(
            x, mesh_lib.logical_sharding(mesh, *names, shape=x.shape))
    return x if order is None else jnp.take(x, inverse(order), axis=1)


def context_parallel(attend, q, k, v, mask: Mask, mesh):
    """attend(q, k, v, mask) with the queries q [B, T, H, Dh] (and mask.q_idx) split over the
    mesh's `context` axis by position and the keys, values and key mask whole on every device
    of the axis (k, v [B, K, S, Dh]). Only `context` is manual: batch rows and heads stay laid
    out by XLA."""
    ctx = mesh_lib.CONTEXT
    window = mask.window
    traced = window is not None and not isinstance(window, int)

    def body(q, k, v, q_idx, key_ok, *w):
        return attend(q, k, v, Mask(q_idx, key_ok, w[0] if traced else window))
    args = (q, k, v, jnp.asarray(mask.q_idx, jnp.int32), mask.key_ok) + ((window,) if traced
                                                                        else ())
    specs = (P(None, ctx), P(), P(), P(ctx), P()) + ((P(),) if traced else ())
    # check_vma off: the blockwise attention's skipped blocks return constants, which the
    # varying-type check would have to be told about in every branch.
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, ctx),
                         axis_names={ctx}, check_vma=False)(*args)


# ------------------------------------------------------------------ splash attention (TPU)

def _tile(n: int, block: int) -> int | None:
    """The largest multiple of 128 (a TPU tile) up to `block` that divides n, if any."""
    return next((b for b in range(block // 128 * 128, 0, -128) if n % b == 0), None)


def splash_fits(queries: int, keys: int, block: int, shards: int = 1) -> bool:
    """Whether splash attention's TPU blocks (multiples of 128) tile the queries of each of
    `shards` devices and the keys; else the blockwise attention stands in."""
    return (queries % shards == 0 and _tile(queries // shards, block) is not None
            and _tile(keys, block) is not None)


def splash(q, k, v, mask: Mask, scale: float, cap: float | None, block: int, mesh,
           interpret: bool = False):
    """Pallas splash attention (TPU) of q [B, T, H, Dh] over k, v [B, S, K, Dh]: the mask's
    causal and window parts are static (block-sparse: hidden blocks are skipped), its key mask
    goes in as segment ids (a padding query sees padding keys: never an empty row). With a
    context axis the queries stay split over it (the kernel's q_seq_shards) and the keys whole.
    Runs in a shard_map over every mesh axis (a Pallas kernel is not partitioned by XLA).
    `interpret`: run the kernel in Pallas' interpreter (tests on the CPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernels)
    B, T, H, Dh = q.shape
    S, K = k.shape[1], k.shape[2]
    q_idx = np.asarray(mask.q_idx, np.int32)
    ctx, cp = mesh_lib.CONTEXT, mesh_lib.context_size(mesh)
    split = cp > 1 and T % cp == 0
    heads = _axis_if(mesh, "tensor", H, K)
    rows = None if mesh is None else mesh_lib.spec_for(("batch",), (B,), mesh)[0]
    bq, bk = _tile(T // (cp if split else 1), block), _tile(S, block)
    kernel = _splash_kernel(q_idx.tobytes(), S, mask.window, H, cap, bq, bk,
                            1 if heads is None else mesh.shape[heads], cp if split else 1,
                            interpret)
    key_ok = mask.key_ok.astype(jnp.int32)
    segments = (jnp.take(key_ok, jnp.asarray(np.minimum(q_idx, S - 1)), axis=1), key_ok)

    def body(kernel, q, k, v, seg_q, seg_kv):
        run = jax.vmap(lambda q, k, v, sq, skv: kernel(q, k, v, segment_ids=kernels.SegmentIds(
            sq, skv)))
        out = run(jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2), jnp.swapaxes(k, 1, 2),
                  jnp.swapaxes(v, 1, 2), seg_q, seg_kv)
        return jnp.swapaxes(out, 1, 2).astype(q.dtype)

    # The share of [query, key] blocks the kernel visits, in its ops' names: XLA counts a
    # Pallas kernel as no work, and aot's count (aot/hlo.py) reads the shapes and this.
    share = visited_share(q_idx, S, mask.window, bq, bk)
    visits = jax.named_scope(f"splash_visits_{share:.6f}")
    if mesh is None:
        with visits:
            return body(kernel, q, k, v, *segments)
    seq = ctx if split else None
    q_spec, kv_spec = P(rows, seq, heads, None), P(rows, None, heads, None)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(heads, seq)))
    with visits:
        return jax.shard_map(body, mesh=mesh, check_vma=False,
                             in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(rows, seq),
                                       P(rows, None)),
                             out_specs=q_spec)(kernel, q, k, v, *segments)


def visited_share(q_idx: np.ndarray, keys: int, window, bq: int, bk: int) -> float:
    """The share of splash's [query block, key block] pairs that its mask does not hide whole
    (the kernel skips those): a query at key index q sees keys s <= q (and q - s < window)."""
    rows = q_idx.reshape(-1, bq)
    hi, lo = rows.max(1)[:, None], rows.min(1)[:, None]
    start = np.arange(0, keys, bk)[None, :]
    seen = start <= hi
    if window is not None:
        seen &= start + bk - 1 > lo - window
    return float(seen.mean())


def _axis_if(mesh, axis: str, *sizes: int):
    """`axis` when the mesh has it and it divides every size, else None."""
    if mesh is None or axis not in mesh.axis_names or any(s % mesh.shape[axis] for s in sizes):
        return None
    return axis


@functools.lru_cache(maxsize=32)
def _splash_kernel(q_idx: bytes, keys: int, window, heads: int, cap, bq: int, bk: int,
                   head_shards: int, q_shards: int, interpret: bool):
    """The splash kernel of one static mask (its block-sparsity is worked out on the host:
    cached, as every layer and retrace asks for the same)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernels, splash_attention_mask as masks)
    order = np.frombuffer(q_idx, np.int32)

    class IndexMask(masks._ComputableMask):  # noqa: SLF001 - splash's lazily computed mask
        """Query row r is at index order[r] of the keys (zig-zag, or after a prompt)."""

        def __init__(self):
            def seen(q, s):
                out = s <= q
                return out if window is None else out & (q - s < window)
            super().__init__((len(order), keys), seen)
            self.q_sequence = order

        def __eq__(self, other):
            return self is other

        def __hash__(self):
            return id(self)

    one = IndexMask()
    sizes = kernels.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                               block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                               block_kv_dq=bk)
    return kernels.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=sizes,
                                   head_shards=head_shards, q_seq_shards=q_shards,
                                   attn_logits_soft_cap=cap, interpret=interpret)
