"""The decode-attention kernel on a GPU (models/decode_attention.py): its output against XLA's
attention (decoder.attention) and both times, one layer's attention at the bench's shape
(Qwen2-0.5B: 14 query heads over 2 KV heads, head dim 64, 256 + 256 slots, bf16) for 64 rows
(one split) and 8 rows (split-K), with the masks of a row mid-completion (left padding, the
slots not generated yet). Run by tools/gpu_session.sh (variant pallas_decode).
`--interpret`: a CPU smoke test at a small size (Pallas' interpreter; no meaningful times).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from gpu_timing import timed  # tools/, beside this script

from grpo_jax.models import decode_attention as da
from grpo_jax.models.decoder import attention

LAYERS = 24  # Qwen2-0.5B's


def main(interpret: bool = False):
    K, G, Dh, S = (2, 7, 64, 512) if not interpret else (2, 7, 64, 160)
    ok = True
    for B in ((64, 8) if not interpret else (4,)):
        rng = np.random.default_rng(B)
        q, k, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16)
                   for s in ((B, 1, K * G, Dh), (B, K, S, Dh), (B, K, S, Dh)))
        pad = rng.integers(0, S // 4, B)
        now = S // 2 + rng.integers(0, S // 2, B)  # each row's own slot, mid-completion
        slots = np.arange(S)[None]
        mask = jnp.asarray((slots >= pad[:, None]) & (slots <= now[:, None]))[:, None]
        kernel = jax.jit(lambda q, k, v, m: da.decode_attention(q, k, v, m, 0.125,
                                                                 interpret=interpret))
        xla = jax.jit(lambda q, k, v, m: attention(q, k, v, m, 0.125))

        def layers(f):  # LAYERS calls in one program, each on the last one's output (no host
            return jax.jit(lambda q, k, v, m: jax.lax.fori_loop(  # dispatch in the times)
                0, LAYERS, lambda _, q: f(q, k, v, m), q))
        gap = float(jnp.abs(kernel(q, k, v, mask).astype(jnp.float32)
                            - xla(q, k, v, mask).astype(jnp.float32)).max())
        ok &= gap < 2e-2
        repeats = 50 if not interpret else 1
        times = [timed(layers(f), q, k, v, mask, repeats=repeats) / LAYERS for f in (kernel, xla)]
        print(f"rows {B} ({da.splits_for(B, K, S, da._sms())} splits): max |pallas - xla| "
              f"{gap:.2e}; per layer (a loop of {LAYERS}): pallas {times[0] * 1e3:.2f} us, xla "
              f"{times[1] * 1e3:.2f} us")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main("--interpret" in sys.argv))
