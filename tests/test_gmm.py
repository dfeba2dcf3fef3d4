"""models/gmm.py: which grouped matmul runs where, and the custom_vjp the Mosaic GPU kernels run
under (wired here around XLA's ragged_dot, checked against jax.grad of the plain op; the kernels
themselves need a Hopper GPU: tools/gpu_session.sh), and the kernels a deviceless trace for an
H100 picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.errors import GrpoJaxError
from grpo_jax.models import gmm


def test_choose_by_backend():
    assert gmm.choose("auto", "tpu") == "megablox"
    assert gmm.choose("auto", "cuda", "9.0") == "mosaic_gpu"
    assert gmm.choose("auto", "cuda", "10.0") == "mosaic_gpu"
    assert gmm.choose("auto", "cuda", "8.0") == "xla"  # A100: no wgmma
    assert gmm.choose("auto", "cuda", None) == "xla"  # no local GPU
    assert gmm.choose("mosaic_gpu", "cuda", None) == "mosaic_gpu"
    assert gmm.choose("auto", "cpu") == "xla"
    assert gmm.choose("xla", "cuda", "9.0") == "xla"
    with pytest.raises(GrpoJaxError, match="moe_gmm='triton'"):
        gmm.choose("triton", "cpu")


def test_block_rule():
    assert gmm.blocks(2048, 768) == gmm.Blocks(128, 128, 64, 4)
    assert gmm.blocks(64, 96) == gmm.Blocks(128, 64, 64, 2)
    assert gmm.fits(2048, 768) and not gmm.fits(16, 24)


def test_custom_vjp_matches_ragged_dot_grad():
    M, K, N, G = 37, 16, 24, 4
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (M, K))
    rhs = jax.random.normal(k2, (G, K, N))
    sizes = jnp.array([9, 0, 20, 5], jnp.int32)  # an empty group; 3 rows in no group
    probe = jax.random.normal(k3, (M, N)).at[34:].set(0)  # rows in no group are unspecified

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b, sizes) * probe)

    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    got = jax.grad(loss(gmm.xla_with_vjp), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gmm.xla_with_vjp(lhs, rhs, sizes)[:34],
                               jax.lax.ragged_dot(lhs, rhs, sizes)[:34], rtol=1e-6)
    # "auto" on CPU is XLA's ragged_dot.
    np.testing.assert_array_equal(jax.jit(gmm.gmm)(lhs, rhs, sizes),
                                  jax.lax.ragged_dot(lhs, rhs, sizes))
    # A shape the kernels take: forced, their branch traced (no GPU here: the forward's kernel
    # traced, then lowered for CPU as XLA's through platform_dependent's default).
    big = jax.random.normal(k2, (G, 64, 128))
    np.testing.assert_array_equal(jax.jit(lambda a, b, s: jax.lax.platform_dependent(
        a, b, s, cuda=gmm.mosaic_gpu_deviceless, default=jax.lax.ragged_dot))(jnp.ones((M, 64)), big, sizes),
                                  jax.lax.ragged_dot(jnp.ones((M, 64)), big, sizes))
    # ... and its gradient (the Mosaic kernels' custom_vjp traced, XLA's lowered).
    probe = jax.random.normal(k3, (M, 128)).at[34:].set(0)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(jnp.ones((M, 64)), big)
    got = jax.jit(jax.grad(loss(lambda a, b, s: jax.lax.platform_dependent(
        a, b, s, cuda=gmm.mosaic_gpu_deviceless, default=jax.lax.ragged_dot)),
        argnums=(0, 1)))(jnp.ones((M, 64)), big)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_deviceless_trace_for_an_h100_runs_all_three_kernels():
    """Compiled without a GPU (grpo_jax.aot's h100 target), the experts' mesh names the chip: its
    abstract device says H100 with 132 SMs, so "auto" picks the Mosaic GPU kernels, and the
    weight gradient's kernel, which sizes its grid from jax.devices() while tracing, sees that
    count. Each Mosaic GPU kernel reads its SM index once (`axis_index[axis_name=sm]`)."""
    import re

    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    sizes = jnp.array([100, 0, 120, 30], jnp.int32)
    args = (jax.ShapeDtypeStruct((256, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 64, 128), jnp.bfloat16))

    def kernels(device, impl="auto"):
        mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=device)
        experts = jax.shard_map(lambda a, b: gmm.gmm(a, b, sizes, impl), mesh=mesh,
                                in_specs=(jax.P(), jax.P()), out_specs=jax.P(), check_vma=False)
        grads = jax.grad(lambda a, b: jnp.sum(experts(a, b)), argnums=(0, 1))
        return len(re.findall(r"axis_index\[axis_name=sm\]", str(jax.jit(grads).trace(*args).jaxpr)))

    cpu = AbstractDevice("cpu", None, "cpu")
    # forward, row gradient and weight gradient
    assert kernels(AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")) == 3
    assert transposed_ragged_dot_mgpu.jax is jax  # the SM count was lent for the trace only
    assert kernels(cpu, "mosaic_gpu") == 2  # no SM count known: XLA's weight gradient
    assert kernels(cpu) == 0
    assert kernels(AbstractDevice("NVIDIA A100-SXM4-80GB", 108, "gpu")) == 0  # no wgmma
    assert gmm.target_gpu() is None  # outside a mesh, on this CPU: no GPU


def test_the_kernel_aot_reports_per_target():
    """What grpo_jax.aot's report says the experts run, by the target chip's kind."""
    h100 = gmm.describe("auto", "cuda", "NVIDIA H100 80GB HBM3", 2048, 768)
    assert h100 == "mosaic_gpu: gate/up 128x128x64, 4 in flight; down 128x128x64, 4 in flight"
    assert gmm.describe("auto", "cuda", "NVIDIA A100-SXM4-80GB", 2048, 768) == "xla"
    gpt_oss = gmm.describe("auto", "cuda", "NVIDIA H100 80GB HBM3", 2880, 2880)  # 45 x 64
    assert gpt_oss == "mosaic_gpu: gate/up 128x64x64, 4 in flight; down 128x64x64, 4 in flight"
    assert gmm.describe("auto", "cuda", "NVIDIA H100 80GB HBM3", 96, 48).startswith("xla (")
    assert gmm.describe("auto", "tpu", "TPU v5 lite", 2048, 768).startswith("megablox")
    assert gmm.describe("xla", "cuda", "NVIDIA H200", 2048, 768) == "xla"
