"""The MoE grouped matmuls on a GPU (models/gmm.py): the Mosaic GPU kernels' forward and both
gradients against XLA's ragged_dot, and their times, at Qwen3-30B-A3B's expert shape (2048 x
768, 128 experts, bf16, uneven groups). Run by tools/gpu_session.sh; needs a Hopper or later GPU.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from gpu_timing import timed  # tools/, beside this script

from grpo_jax.models import gmm


def main(rows=8192, E=128, D=2048, F=768):
    gpu = gmm.target_gpu()
    print("chosen:", gmm.choose("auto", jax.default_backend(), gpu and gpu.compute_capability),
          gpu)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    share = jax.random.dirichlet(k1, jnp.full((E,), 0.5))
    sizes = jnp.floor(share * rows).astype(jnp.int32)
    sizes = sizes.at[0].add(rows - sizes.sum())
    x = jax.random.normal(k2, (rows, D), jnp.bfloat16)
    w = jax.random.normal(k3, (E, D, F), jnp.bfloat16) * 0.02
    dy = jax.random.normal(k4, (rows, F), jnp.bfloat16)
    ok = True
    for name, f in (("mosaic_gpu", gmm.mosaic_gpu), ("xla", jax.lax.ragged_dot)):
        fwd = jax.jit(lambda a, b: f(a, b, sizes))
        bwd = jax.jit(lambda a, b: jax.vjp(lambda a, b: f(a, b, sizes), a, b)[1](dy))
        print(f"{name}: forward {timed(fwd, x, w, repeats=10):.3f} ms, both gradients "
              f"{timed(bwd, x, w, repeats=10):.3f} ms")
    got = [gmm.mosaic_gpu(x, w, sizes), *jax.vjp(lambda a, b: gmm.mosaic_gpu(a, b, sizes),
                                                 x, w)[1](dy)]
    want = [jax.lax.ragged_dot(x, w, sizes), *jax.vjp(
        lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)[1](dy)]
    for what, g, r in zip(("forward", "d rows", "d weights"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        err = float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-30))
        print(f"{what}: bit-identical {bool(np.array_equal(g, r))}, max rel err {err:.2e}")
        ok &= err < 1e-2  # bf16 outputs: a few ulps of the largest value
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
