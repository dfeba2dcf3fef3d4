"""The tools' kernel timer (tools/*_gpu_check.py): milliseconds per call of a jitted `f`,
`repeats` calls dispatched back to back and waited for once, after a call that compiles and
warms up (a kernel's time, not the host's round trip per call)."""

import time

import jax


def timed(f, *args, repeats: int):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(repeats):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats * 1e3
