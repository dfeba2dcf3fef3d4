"""A fused split-K decode-attention kernel for GPUs (Pallas, Triton lowering): the one query
token of a decode step over a layer's KV cache, in one launch where XLA's attention takes four
(two matmuls, the masked softmax, the reduction; docs/benchmarks.md).

Why not jax's `pallas.ops.gpu.decode_attention.gqa`: it takes each row's keys as one range
[start_idx, kv_seq_len), and the sampler's decode mask is not always one range per row. The main
sampler's rows are (left padding, then prompt and generated slots: one range), but a continued
tool turn's cache holds the earlier content, the new turn's own left padding and the completion
slots one after the other (rollout/native/continuation.py: gaps inside a row), partial and
refilled rows are rebuilt per slot (refill.py, partial.py), and a sliding layer's ring cache
(decoder._ring_mask) wraps around. So this kernel reads the dense [B, S] key mask the decoder
already builds (one byte per slot, shared by every layer) instead of a range; otherwise it
follows jax's kernel: grid (row, KV head, split), the G = H / K query heads of a KV head
together (padded to 16 rows for the tensor-core dot, masked on load and store), an online
softmax over key blocks of BLOCK_K, and the splits' partial results combined by a second
kernel (one launch, where XLA's combine takes two).

Masked slots are skipped in the loads (a masked lane reads no memory): the slots a row has not
generated yet, and its padding, cost no bandwidth. A query that sees no key at all (a row of
padding, read by nothing) comes out 0 where XLA's attention averages every value.

Where it runs (Numerics.decode_attention): "pallas" lowers the Triton kernel for CUDA
(jax.lax.platform_dependent, so a deviceless compile for an H100 from a CPU machine compiles
the kernel: tools/gpu_aot.py); on a CPU the same kernel runs in Pallas' interpreter (tests;
slow: use "xla" for real work on a CPU); traced for a TPU it is refused. No soft-capping
(Gemma 2), no sinks (gpt-oss), and head dims that are not a power of two (Triton's tiles):
there the decoder keeps XLA's attention (`fits`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import GrpoJaxError

BLOCK_K = 64   # keys per step of a program's loop
MIN_ROWS = 16  # the tensor-core dot's smallest M: a KV head's G query heads padded to this
H100_SMS = 132  # where no GPU says its count (a deviceless compile)
NEG = -1e30


def fits(head_dim: int, cap, sinks) -> bool:
    """Whether the kernel computes this layer's attention: no soft-capping, no sinks, and a
    head dim that is a power of two >= 16 (a Triton tile)."""
    return cap is None and sinks is None and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def splits_for(rows: int, kv_heads: int, keys: int, sms: int | None = None) -> int:
    """Key splits per (row, KV head), FlashAttention-2's rule (num_splits_heuristic) cut short:
    one split when the (row, KV head) programs already fill 80% of the SMs (no combine
    kernel: the output is written normalized), else enough splits for one program per SM, no
    more than the key blocks. The bench's 64 rows x 2 KV heads on an H100's 132 SMs: 1; 8 rows:
    8 (the 8 key blocks of 512 keys)."""
    sms = sms or H100_SMS
    programs = rows * kv_heads
    if programs >= 0.8 * sms:
        return 1
    return max(1, min(-(-sms // programs), -(-keys // BLOCK_K)))


def _kernel(q_ref, k_ref, v_ref, ok_ref, *out_refs, scale: float, groups: int, rows: int,
            keys: int, split_len: int, normalize: bool):
    """One (row, KV head, split): q_ref [rows >= groups, Dh] (rows past `groups` are padding),
    k_ref, v_ref [split_len, Dh], ok_ref [split_len] int8 (1: a real key). Writes the
    split's output (normalized when there is one split) and, for several, its softmax max and
    sum."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    split = pl.program_id(2)
    head_ok = jnp.arange(rows) < groups
    q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=head_ok[:, None], other=0.0)
    dh = q.shape[-1]

    def body(j, carry):
        o, m, l = carry
        at = pl.ds(j * BLOCK_K, BLOCK_K)
        inside = split * split_len + j * BLOCK_K + jnp.arange(BLOCK_K) < keys
        ok = plgpu.load(ok_ref.at[at], mask=inside, other=0) != 0
        k = plgpu.load(k_ref.at[at, :], mask=ok[:, None], other=0.0)
        s = plgpu.dot(q, k.astype(q.dtype), trans_b=True) * scale  # [rows, BLOCK_K] fp32
        s = jnp.where(ok[None, :], s, NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        v = plgpu.load(v_ref.at[at, :], mask=ok[:, None], other=0.0)
        o = o * corr[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return o, m_new, l * corr + p.sum(axis=-1)

    init = (jnp.zeros((rows, dh), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, split_len // BLOCK_K, body, init)
    if normalize:
        (o_ref,) = out_refs
        out = o / jnp.maximum(l, 1e-30)[:, None]
        plgpu.store(o_ref.at[pl.ds(0, rows), :], out.astype(o_ref.dtype), mask=head_ok[:, None])
        return
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref.at[pl.ds(0, rows), :], o, mask=head_ok[:, None])
    plgpu.store(m_ref.at[pl.ds(0, rows)], m, mask=head_ok)
    plgpu.store(l_ref.at[pl.ds(0, rows)], l, mask=head_ok)


def decode_attention(q, k, v, key_ok, scale: float, splits: int | None = None,
                     interpret: bool = False, sms: int | None = None):
    """One query token per row: q [B, 1, H, Dh] over the cache k, v [B, K, S, Dh], key_ok
    [B, S] (or the decoder's [B, 1, S]) bool: which slots the query sees. Returns
    [B, 1, H, Dh] in q's dtype. `splits`: key splits per (row, KV head) (default
    splits_for); `interpret`: run in Pallas' interpreter (CPU)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, T, H, Dh = q.shape
    K, S = k.shape[1], k.shape[2]
    if T != 1:
        raise GrpoJaxError(f"decode attention takes one query token per row, not {T}")
    G = H // K
    rows = max(MIN_ROWS, 1 << (G - 1).bit_length())
    splits = splits or splits_for(B, K, S, sms)
    split_len = -(-S // (splits * BLOCK_K)) * BLOCK_K
    splits = -(-S // split_len)
    qg = q.reshape(B, K, G, Dh)  # one token: no data moves
    ok = key_ok.reshape(B, S).astype(jnp.int8)
    normalize = splits == 1
    kernel = functools.partial(_kernel, scale=scale, groups=G, rows=rows, keys=S,
                               split_len=split_len, normalize=normalize)
    if normalize:
        out_shape = [jax.ShapeDtypeStruct((B, K, G, Dh), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows, Dh), lambda b, h, s: (b, h, 0, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, K, splits, G, Dh), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, splits, G), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, splits, G), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, rows, Dh), lambda b, h, s: (b, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))]
    kv_spec = pl.BlockSpec((None, None, split_len, Dh), lambda b, h, s: (b, h, s, 0))
    outs = pl.pallas_call(
        kernel, grid=(B, K, splits),
        in_specs=[pl.BlockSpec((None, None, rows, Dh), lambda b, h, s: (b, h, 0, 0)),
                  kv_spec, kv_spec,
                  pl.BlockSpec((None, split_len), lambda b, h, s: (b, s))],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="decode_attention")(qg, k, v, ok)
    if normalize:
        return outs[0].reshape(B, 1, H, Dh)
    # The splits combined in a second kernel (XLA takes two fusions: the max over the splits,
    # then the rescaled sums), each split's sum rescaled to the common max.
    span = 1 << (splits - 1).bit_length()  # the splits padded to a power of two (Triton)
    part = lambda *shape: pl.BlockSpec((None, None, span, *shape),  # noqa: E731
                                       lambda b, h: (b, h, 0) + (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_combine, groups=G, rows=rows, splits=splits, span=span),
        grid=(B, K), in_specs=[part(rows, Dh), part(rows), part(rows)],
        out_specs=pl.BlockSpec((None, None, rows, Dh), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, G, Dh), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="decode_attention_combine")(*outs)
    return out.reshape(B, 1, H, Dh)


def _combine(o_ref, m_ref, l_ref, out_ref, *, groups: int, rows: int, splits: int, span: int):
    """One (row, KV head): the splits' outputs o_ref [span, rows, Dh] (unnormalized), maxima
    and sums m_ref, l_ref [span, rows] (splits past `splits` and rows past `groups` are
    padding) into out_ref [rows, Dh]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    ok = (jnp.arange(span) < splits)[:, None] & (jnp.arange(rows) < groups)[None, :]
    m = plgpu.load(m_ref.at[pl.ds(0, span), pl.ds(0, rows)], mask=ok, other=NEG)
    l = plgpu.load(l_ref.at[pl.ds(0, span), pl.ds(0, rows)], mask=ok, other=0.0)
    o = plgpu.load(o_ref.at[pl.ds(0, span), pl.ds(0, rows), :], mask=ok[:, :, None], other=0.0)
    w = jnp.exp(m - m.max(axis=0)[None, :])  # [span, rows]
    total = jnp.maximum((l * w).sum(axis=0), 1e-30)
    out = (o * w[:, :, None]).sum(axis=0) / total[:, None]
    plgpu.store(out_ref.at[pl.ds(0, rows), :], out.astype(out_ref.dtype),
                mask=(jnp.arange(rows) < groups)[:, None])


def _sms() -> int | None:
    """The SM count of the GPU traced for, where known (models/gmm.py's target_gpu)."""
    from grpo_jax.models import gmm
    gpu = gmm.target_gpu()
    return gpu.sms if gpu else None


def attend(q, k, v, mask, scale: float, mesh=None):
    """Numerics.decode_attention "pallas": the kernel lowered for CUDA, in Pallas' interpreter
    on a CPU; refused when traced for a TPU. q [B, 1, H, Dh], k, v [B, K, S, Dh], mask
    [B, 1, S]. With a mesh of several devices the kernel runs per device in a shard_map (rows
    over the batch axes, KV heads over `tensor` where it divides both head counts): XLA does
    not partition a custom call."""
    from grpo_jax.models.config import target_platform
    if target_platform() == "tpu":
        raise GrpoJaxError("numerics.decode_attention='pallas' is a GPU (Triton) kernel: use "
                           "'auto' or 'xla' on a TPU")
    sms = _sms()
    B, _, H, _ = q.shape
    K = k.shape[1]

    def run(q, k, v, mask):
        ok = mask.reshape(q.shape[0], -1)
        gpu = functools.partial(decode_attention, scale=scale, sms=sms)
        cpu = functools.partial(decode_attention, scale=scale, sms=sms, interpret=True)
        return jax.lax.platform_dependent(q, k, v, ok, cuda=gpu, default=cpu)

    if mesh is None or math.prod(mesh.shape.values()) == 1:
        return run(q, k, v, mask)
    rows = mesh_lib.spec_for(("batch",), (B,), mesh)[0]
    heads = ("tensor" if "tensor" in mesh.axis_names and H % mesh.shape["tensor"] == 0
             and K % mesh.shape["tensor"] == 0 else None)
    q_spec, kv_spec = P(rows, None, heads, None), P(rows, heads, None, None)
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(rows, None, None)),
                         out_specs=q_spec, check_vma=False)(q, k, v, mask)
