"""The decode-attention kernel (models/decode_attention.py) in Pallas' interpreter against XLA's
attention (decoder.attention), on the masks the sampler builds, and the sampler's greedy tokens
with numerics.decode_attention "pallas" against "xla"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import GrpoJaxError
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.models import decode_attention as da
from grpo_jax.models.config import tracing_for
from grpo_jax.models.decoder import attention
from grpo_jax.rollout import Sampler, SamplingParams


def _masks(B: int, S: int, kind: str, rng) -> np.ndarray:
    """[B, S] bool key masks of the sampler's kinds, each row seeing its own slot (the last
    real one)."""
    ok = np.zeros((B, S), bool)
    for b in range(B):
        now = S - 1 - 7 * b  # rows at different steps: the slots after `now` not written yet
        if kind == "left_padding":  # the main sampler: padding, then prompt and completion
            ok[b, 3 + 11 * b:now + 1] = True
        elif kind == "gaps":  # a continued tool turn: content, the turn's padding, completion
            ok[b, 2 * b:40] = True
            ok[b, 40 + 5 + b:now + 1] = True
        else:  # anything (a ring cache, refilled rows)
            ok[b] = rng.random(S) < 0.5
            ok[b, now] = True
    return ok


@pytest.mark.parametrize("G,dtype,splits,S,kind", [
    (1, jnp.float32, 1, 100, "left_padding"),   # MQA-like group of 1, keys not a block multiple
    (4, jnp.float32, 3, 200, "gaps"),            # several splits, one wholly masked
    (7, jnp.bfloat16, 2, 256, "random"),         # Qwen2-0.5B's 7 heads per KV head, bf16
])
def test_kernel_matches_xla(G, dtype, splits, S, kind):
    rng = np.random.default_rng(G)
    B, K, Dh = 3, 2, 32
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype)
               for shape in ((B, 1, K * G, Dh), (B, K, S, Dh), (B, K, S, Dh)))
    ok = jnp.asarray(_masks(B, S, kind, rng))
    out = da.decode_attention(q, k, v, ok, 0.17, splits=splits, interpret=True)
    ref = attention(q, k, v, ok[:, None], 0.17)
    assert out.shape == ref.shape and out.dtype == q.dtype
    # bf16: XLA rounds the normalized probabilities to bf16 before the values, the kernel the
    # unnormalized ones; outputs are O(1).
    atol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=atol)


def test_mesh_and_platform_rules():
    rng = np.random.default_rng(0)
    B, K, G, S, Dh = 4, 2, 2, 64, 16
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((B, 1, K * G, Dh), (B, K, S, Dh), (B, K, S, Dh)))
    mask = jnp.asarray(_masks(B, S, "left_padding", rng))[:, None]
    ref = attention(q, k, v, mask, 0.25)
    devices = jax.devices()
    if len(devices) >= 4:  # rows over the batch axes, KV heads over `tensor`: per device
        mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, tp=2), devices[:4])
        out = jax.jit(lambda *a: da.attend(*a, 0.25, mesh))(q, k, v, mask)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    with tracing_for("tpu"), pytest.raises(GrpoJaxError, match="GPU \\(Triton\\) kernel"):
        da.attend(q, k, v, mask, 0.25)
    assert da.fits(64, None, None) and da.fits(128, None, None)
    assert not da.fits(64, 50.0, None) and not da.fits(64, None, jnp.zeros(4))
    assert not da.fits(80, None, None)  # not a Triton tile: XLA's attention
    assert da.splits_for(64, 2, 512, 132) == 1  # the bench's shape fills an H100
    assert da.splits_for(8, 2, 512, 132) == 8 and da.splits_for(1, 1, 100, 132) == 2


@pytest.mark.slow  # 9 s: two samplers compiled, one with the interpreted kernel
def test_sampler_greedy_tokens_match_xla(monkeypatch):
    cfg = ModelConfig("qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True).replace(
                          dtype="float32", param_dtype="float32")
    prompts = [[5, 17, 9, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 6, 3]]
    sp = SamplingParams(max_completion_length=6, temperature=0)
    outs, calls = {}, []
    kernel = da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for impl in ("xla", "pallas"):
        c = cfg.replace(decode_attention=impl)
        model = Decoder(c, rngs=nnx.Rngs(0))
        outs[impl] = Sampler(c, sp, pad_id=0).generate(model, prompts)
    assert calls  # traced: the pallas sampler's decode step ran the kernel
    np.testing.assert_array_equal(outs["pallas"].completion_ids, outs["xla"].completion_ids)
    assert len(set(outs["xla"].completion_ids.ravel().tolist())) > 2  # not one repeated token
    np.testing.assert_allclose(outs["pallas"].sampler_logp, outs["xla"].sampler_logp, atol=1e-5)
