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

Which GPU a program is for (target_gpu): the local one, or in a compile without one (grpo_jax.aot's
h100 target, tools/gpu_aot.py) the abstract device of the mesh the experts are traced under
(moe.py runs them in shard_map, whose mesh of compile-only devices names the chip and its SM
count), so a deviceless compile runs the kernels the device would run.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.config.model import MOE_GMM
from grpo_jax.errors import GrpoJaxError

IMPLS = MOE_GMM
MEGABLOX_TILE = 128
HOPPER = 9.0  # Mosaic GPU's wgmma kernels need sm_90 or later
# Compute capability by device kind, for a GPU known only by its description (a deviceless
# compile's); first match wins.
KIND_CAPABILITY = (("GB200", "10.0"), ("B200", "10.0"), ("B100", "10.0"), ("GH200", "9.0"),
                   ("H200", "9.0"), ("H100", "9.0"), ("H800", "9.0"), ("H20", "9.0"))


def choose(impl: str, platform: str, compute_capability: str | None = None) -> str:
    """The implementation that runs for a requested `impl` when lowering for `platform` ("cpu",
    "cuda", "tpu"). compute_capability: the target GPU's ("9.0", target_gpu), None where
    unknown (then XLA's)."""
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


class TargetGpu(NamedTuple):
    """The GPU a program is traced for."""

    compute_capability: str | None  # "9.0"; None for a kind KIND_CAPABILITY does not know
    sms: int | None  # streaming multiprocessors
    local: bool  # a device of this process (else a deviceless compile's description)


def target_gpu() -> TargetGpu | None:
    """The local GPU, else the GPU of the mesh being traced under (shard_map's abstract mesh,
    whose devices in a deviceless compile are the target's descriptions); None for neither."""
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        return TargetGpu(device.compute_capability, device.core_count, True)
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None or device.platform != "gpu":
        return None
    capability = next((cc for kind, cc in KIND_CAPABILITY if kind in device.device_kind), None)
    return TargetGpu(capability, device.num_cores, False)


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


def describe(impl: str, platform: str, device_kind: str, d: int, f: int) -> str:
    """What the experts of width d -> f -> d run on `platform` ("cuda", "tpu", "cpu") for a
    device of `device_kind`: the implementation and, for Mosaic GPU, the blocks per product
    (as grpo_jax.aot reports it)."""
    capability = next((cc for kind, cc in KIND_CAPABILITY if kind in device_kind), None)
    name = choose(impl, platform, capability)
    if name == "mosaic_gpu" and not fits(d, f):
        return "xla (the expert width is not a multiple of 64)"
    if name == "megablox":
        return f"megablox, tiles {MEGABLOX_TILE}x{MEGABLOX_TILE}x{MEGABLOX_TILE}"
    if name != "mosaic_gpu":
        return name
    parts = []
    for what, k, n in (("gate/up", d, f), ("down", f, d)):
        b = blocks(k, n)
        parts.append(f"{what} {b.block_m}x{b.block_n}x{b.block_k}, {b.max_concurrent_steps} "
                     "in flight")
    return "mosaic_gpu: " + "; ".join(parts)


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


def _mgpu_tgmm(lhs, dout, sizes, sms: int | None = None):
    """[G, K, N]: per group lhs_g^T @ dout_g (lhs [M, K], dout [M, N] grouped alike). `sms`:
    the target GPU's SM count where no local GPU gives it (a deviceless compile)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    b = blocks(lhs.shape[0], dout.shape[1])
    b = b._replace(block_m=128 if lhs.shape[1] % 128 == 0 else 64)
    seen = contextlib.nullcontext() if sms is None else _devices_seen_by(
        transposed_ragged_dot_mgpu, sms)
    with seen:
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, dout, group_sizes=sizes, **b._asdict())


@contextlib.contextmanager
def _devices_seen_by(module, sms: int):
    """While `module` is traced, its `jax.devices()` is one GPU description with `sms` SMs.
    Why: jax's transposed_ragged_dot_mgpu (0.10-0.11) sizes its grid from
    jax.devices()[0].core_count and takes no count; a deviceless compile's devices are the
    host's CPUs. Everything else the module reads from `jax` is jax's own."""
    real = module.jax

    class Jax(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

    shim = Jax("jax")
    shim.devices = lambda *_, **__: [types.SimpleNamespace(core_count=sms)]
    module.jax = shim
    try:
        yield
    finally:
        module.jax = real


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
# Traced where no GPU is known (neither local nor the mesh's): the weight gradient by XLA, since
# transposed_ragged_dot_mgpu needs an SM count to be traced at all.
mosaic_gpu_deviceless = with_vjp(_mgpu_fwd, _xla_tgmm)


def mosaic_gpu_for(gpu: TargetGpu | None) -> Callable:
    """The Mosaic GPU kernels for the GPU a program is traced for."""
    if gpu is None or gpu.sms is None:
        return mosaic_gpu_deviceless
    return mosaic_gpu if gpu.local else with_vjp(
        _mgpu_fwd, functools.partial(_mgpu_tgmm, sms=gpu.sms))


def megablox(lhs, rhs, sizes):
    from jax.experimental.pallas.ops.tpu.megablox import ops
    m = lhs.shape[0]
    lhs = jnp.pad(lhs, ((0, -m % MEGABLOX_TILE), (0, 0)))
    return ops.gmm(lhs, rhs, sizes, lhs.dtype, (MEGABLOX_TILE,) * 3)[:m]


def gmm(lhs, rhs, sizes, impl: str = "auto"):
    """lhs [M, K] @ rhs [G, K, N] per group of `sizes`, by the implementation `impl` resolves to
    for the platform the program is lowered for (choose)."""
    gpu = target_gpu()
    cc = gpu.compute_capability if gpu else None
    run = {"xla": jax.lax.ragged_dot, "megablox": megablox, "mosaic_gpu": mosaic_gpu_for(gpu)}
    if impl != "auto":
        return run[choose(impl, "cpu")](lhs, rhs, sizes)
    on_cuda = choose(impl, "cuda", cc)
    if on_cuda == "mosaic_gpu" and not fits(*rhs.shape[1:]):
        on_cuda = "xla"
    cuda = run[on_cuda]
    return jax.lax.platform_dependent(lhs, rhs, sizes, tpu=megablox, cuda=cuda,
                                      default=jax.lax.ragged_dot)
