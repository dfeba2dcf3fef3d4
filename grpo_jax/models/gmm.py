"""Grouped matmuls for the experts (models/moe.py): which implementation runs, and the Mosaic
GPU kernels' gradient.

`lhs [M, K] @ rhs [G, K, N]`, lhs's rows grouped by `sizes` [G] (rows past the last group come
out unspecified; moe.py masks them). Implementations (Numerics.moe_gmm, "auto" picks):
- "megablox": jax's Pallas TPU gmm/tgmm (TPU; the weight gradient visits each group's rows only).
- "mosaic_gpu": jax's Mosaic GPU ragged_dot_mgpu (forward and row gradient, the latter with the
  weights transposed) and transposed_ragged_dot_mgpu (the weight gradient), Hopper (sm_90) and
  later: XLA's ragged_dot is a masked dense product over every expert on GPUs (Qwen3-30B-A3B
  runs out of memory at 16 x 512 tokens, docs/benchmarks.md 2026-11-26); these were measured
  bit-identical and 14-17x faster on an H100.
- "xla": jax.lax.ragged_dot (CPU, GPUs before Hopper, and the oracle in tests).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.config.model import MOE_GMM
from grpo_jax.errors import GrpoJaxError

IMPLS = MOE_GMM
MEGABLOX_TILE = 128
HOPPER = 9.0  # Mosaic GPU's wgmma kernels need sm_90 or later


def choose(impl: str, platform: str, compute_capability: str | None = None) -> str:
    """The implementation that runs for a requested `impl` when lowering for `platform` ("cpu",
    "cuda", "tpu"). compute_capability: the local GPU's ("9.0"), None when the program is
    compiled without one (grpo_jax.aot's deviceless GPU target is an H100: Hopper)."""
    if impl not in IMPLS:
        raise GrpoJaxError(f"moe_gmm={impl!r}: use one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "megablox"
    if platform == "cuda" and compute_capability is not None \
            and float(compute_capability) >= HOPPER:
        return "mosaic_gpu"
    return "xla"


def local_compute_capability() -> str | None:
    """The default device's CUDA compute capability; None without a local GPU runtime."""
    if jax.default_backend() != "gpu":
        return None
    return jax.devices()[0].compute_capability


class Blocks(NamedTuple):
    """Mosaic GPU tile sizes for one product."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int = 1


def blocks(k: int, n: int) -> Blocks:
    """The tile rule for a product contracting k into n outputs: 128-row tiles (one wgmma M of
    two warpgroups' worth), n tiles of 128 where n divides (else 64), k tiles of 64 (bf16: 128
    bytes, the widest TMA swizzle), and 2 to 4 k steps in flight (the pipeline delays a
    release by one step: at least 2; 4 x (128 + 128) x 64 x 2 bytes = 128 KiB of the 228 KiB
    shared memory). The weight gradient's m tile (over k) is 128 where k divides, else 64."""
    block_n = 128 if n % 128 == 0 else 64
    return Blocks(128, block_n, 64, max(2, min(4, k // 64)))


def fits(k: int, n: int) -> bool:
    """Whether the Mosaic GPU kernels take rhs [G, k, n]: both sides whole 64-wide tiles (the
    forward and row gradient contract k and n in 64-wide k tiles; the weight gradient tiles k
    and n by blocks()). Other shapes (tiny test models) run XLA's ragged_dot."""
    return k % 64 == 0 and n % 64 == 0


def _mgpu_fwd(lhs, rhs, sizes, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, transpose_rhs=transpose_rhs,
                                      **blocks(lhs.shape[1], n)._asdict())


def _mgpu_tgmm(lhs, dout, sizes):
    """[G, K, N]: per group lhs_g^T @ dout_g (lhs [M, K], dout [M, N] grouped alike)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    b = blocks(lhs.shape[0], dout.shape[1])
    b = b._replace(block_m=128 if lhs.shape[1] % 128 == 0 else 64)
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs, dout, group_sizes=sizes, **b._asdict())


def _xla_tgmm(lhs, dout, sizes):
    """The weight gradient by XLA (the reference for the custom_vjp's wiring in tests)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, dout, sizes, dims)


def with_vjp(fwd: Callable, tgmm: Callable) -> Callable:
    """A grouped matmul whose gradient runs the given kernels: d lhs = fwd(dout, rhs^T), d rhs =
    tgmm(lhs, dout). fwd(lhs, rhs, sizes, transpose_rhs) and tgmm(lhs, dout, sizes)."""
    @jax.custom_vjp
    def gmm(lhs, rhs, sizes):
        return fwd(lhs, rhs, sizes, False)

    def gmm_fwd(lhs, rhs, sizes):
        return fwd(lhs, rhs, sizes, False), (lhs, rhs, sizes)

    def gmm_bwd(res, dout):
        lhs, rhs, sizes = res
        dout = dout.astype(lhs.dtype)
        dlhs = fwd(dout, rhs, sizes, True)
        drhs = tgmm(lhs, dout, sizes).astype(rhs.dtype)
        return dlhs, drhs, None

    gmm.defvjp(gmm_fwd, gmm_bwd)
    return gmm


def _xla_fwd(lhs, rhs, sizes, transpose_rhs=False):
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, sizes)


# The custom_vjp with XLA's kernels inside: tests check the wiring against jax.grad of ragged_dot.
xla_with_vjp = with_vjp(_xla_fwd, _xla_tgmm)
mosaic_gpu = with_vjp(_mgpu_fwd, _mgpu_tgmm)
# Without a local GPU (a deviceless compile): the weight gradient by XLA, since
# transposed_ragged_dot_mgpu sizes its grid from jax.devices()[0].core_count while tracing.
mosaic_gpu_deviceless = with_vjp(_mgpu_fwd, _xla_tgmm)


def megablox(lhs, rhs, sizes):
    from jax.experimental.pallas.ops.tpu.megablox import ops
    m = lhs.shape[0]
    lhs = jnp.pad(lhs, ((0, -m % MEGABLOX_TILE), (0, 0)))
    return ops.gmm(lhs, rhs, sizes, lhs.dtype, (MEGABLOX_TILE,) * 3)[:m]


def gmm(lhs, rhs, sizes, impl: str = "auto"):
    """lhs [M, K] @ rhs [G, K, N] per group of `sizes`, by the implementation `impl` resolves to
    for the platform the program is lowered for (choose)."""
    cc = local_compute_capability()
    run = {"xla": jax.lax.ragged_dot, "megablox": megablox,
           "mosaic_gpu": mosaic_gpu if cc else mosaic_gpu_deviceless}
    if impl != "auto":
        return run[choose(impl, "cpu")](lhs, rhs, sizes)
    on_cuda = choose(impl, "cuda", cc)
    if on_cuda == "mosaic_gpu" and not fits(*rhs.shape[1:]):
        on_cuda = "xla"
    cuda = run[on_cuda]
    return jax.lax.platform_dependent(lhs, rhs, sizes, tpu=megablox, cuda=cuda,
                                      default=jax.lax.ragged_dot)
