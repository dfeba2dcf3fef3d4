"""Would a decode loop that scans its layers over one stacked KV cache copy the cache? Compiled,
without the hardware, for an H100, a TPU v5e chip and this CPU (docs/testing.md: the sampler's
unrolled layers are most of the suite's sampler compile time).

    .venv-aot/bin/python tools/stacked_cache_aot.py h100:1   # or v5e:2x2, or cpu

A toy layer at Qwen2-0.5B's widths (24 layers, 64 rows, 512 slots, bf16), 64 decode steps under
one fori_loop, two ways: the cache as one [L, B, K, S, Dh] buffer per K and V carried through a
lax.scan over the layers (each layer writes its token with dynamic_update_slice, then reads its
slice: read after write, so the update can stay in place), and as one buffer per layer with the
layers unrolled (what the sampler does on a GPU: numerics.sampler_layers "auto"; the first way
is what it does on a TPU and on a CPU in float32). Prints the compiled program's temporaries and
the copies of cache-sized and layer-sized buffers it holds. Not part of the test suite.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

jax.config.update("jax_platforms", "cpu")  # compile-only
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grpo_jax.aot import hardware  # noqa: E402

L, B, K, H, S, Dh, D, F = 24, 64, 2, 14, 512, 64, 896, 4864
DT = jnp.bfloat16


def qkv(x, w):
    h = x @ w["wqkv"]
    q = h[:, :H * Dh].reshape(B, H, Dh)
    k = h[:, H * Dh:(H + K) * Dh].reshape(B, K, 1, Dh)
    v = h[:, (H + K) * Dh:].reshape(B, K, 1, Dh)
    return q, k.astype(DT), v.astype(DT)


def attend_and_mlp(x, w, q, ck, cv, pos):
    s = jnp.einsum("bkgd,bksd->bkgs", q.reshape(B, K, H // K, Dh), ck).astype(jnp.float32)
    p = jax.nn.softmax(jnp.where(jnp.arange(S) <= pos, s, -1e30), -1).astype(DT)
    o = jnp.einsum("bkgs,bksd->bkgd", p, cv).reshape(B, H * Dh)
    return x + o @ w["wo"] + jax.nn.silu(x @ w["wi"]) @ w["wo2"]


def stacked_step(ws, x, cache, pos):
    def layer(carry, xs):
        x, ck, cv = carry
        i, w = xs
        q, k, v = qkv(x, w)
        ck = jax.lax.dynamic_update_slice(ck, k[None], (i, 0, 0, pos, 0))
        cv = jax.lax.dynamic_update_slice(cv, v[None], (i, 0, 0, pos, 0))
        x = attend_and_mlp(x, w, q, jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False),
                           jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False), pos)
        return (x, ck, cv), None
    (x, ck, cv), _ = jax.lax.scan(layer, (x, *cache), (jnp.arange(L), ws))
    return x, (ck, cv)


def unrolled_step(ws, x, cache, pos):
    ks, vs = list(cache[0]), list(cache[1])
    for i in range(L):
        w = jax.tree.map(lambda a: a[i], ws)  # noqa: B023
        q, k, v = qkv(x, w)
        ks[i] = jax.lax.dynamic_update_slice(ks[i], k, (0, 0, pos, 0))
        vs[i] = jax.lax.dynamic_update_slice(vs[i], v, (0, 0, pos, 0))
        x = attend_and_mlp(x, w, q, ks[i], vs[i], pos)
    return x, (tuple(ks), tuple(vs))


def decode(step, ws, x, cache, steps=64):
    def body(j, carry):
        x, cache = step(ws, *carry, j)
        return x.astype(DT), cache
    return jax.lax.fori_loop(0, steps, body, (x, cache))


def main(target: str) -> None:
    dev = (jax.devices("cpu")[0] if target == "cpu"
           else hardware.devices(hardware.parse_target(target))[0])
    sharding = SingleDeviceSharding(dev)
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, DT)  # noqa: E731
    ws = {"wqkv": spec(L, D, (H + 2 * K) * Dh), "wo": spec(L, H * Dh, D), "wi": spec(L, D, F),
          "wo2": spec(L, F, D)}
    layouts = {"stacked, scanned": (stacked_step, (spec(L, B, K, S, Dh),) * 2),
               "per layer, unrolled": (unrolled_step, (tuple(spec(B, K, S, Dh)
                                                              for _ in range(L)),) * 2)}
    print(f"{dev}: KV cache {2 * L * B * K * S * Dh * 2 / 2**20:.0f} MiB, "
          f"a layer's K and V {2 * B * K * S * Dh * 2 / 2**20:.0f} MiB")
    for name, (step, cache) in layouts.items():
        fn = jax.jit(lambda ws, x, c, step=step: decode(step, ws, x, c), donate_argnums=(2,),
                     in_shardings=sharding, out_shardings=sharding)
        compiled = fn.lower(ws, spec(B, D), cache).compile()
        hlo, mem = compiled.as_text(), compiled.memory_analysis()
        whole, one = f"{L},{B},{K},{S},{Dh}]", f"{B},{K},{S},{Dh}]"
        ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z-]+)\((.*)$", hlo, re.M)
        copies = [t for t, op, _ in ops if op in ("copy", "copy-start") and whole in t]
        # A layer's keys or values written to a buffer of their own before attention reads them
        # (a loop fusion of a dynamic slice), where an address computation would do.
        slices = [t for t, op, rest in ops if op == "fusion" and one in t
                  and "kind=kLoop" in rest and "calls=%fused_dynamic_slice" in rest]
        print(f"{name}: temporaries {mem.temp_size_in_bytes / 2**20:.1f} MiB, donated cache "
              f"aliased {mem.alias_size_in_bytes / 2**20:.0f} MiB, whole-cache copies "
              f"{len(copies)}, layers' K/V sliced into buffers of their own {len(slices)} "
              "(per layer and step)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "h100:1")
