"""Long sequences (models/attention.py): the blockwise attention against the plain one, and the
mesh's context axis (positions split over devices, zig-zag) against one device: forward logits,
log-probs and gradients of the update, and the sampler's tokens with its KV cache split by
position and chunked prefill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import mesh as mesh_lib
from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.grpo.train_step import (StepConfig, completion_logps, completion_logps_and_router,
                                      loss_and_grads)
from grpo_jax.models import Decoder, ModelConfig, decoder, positions_from_mask
from grpo_jax.models.attention import Mask, flash, zigzag_order
from grpo_jax.rollout import Sampler, SamplingParams
from shared_prefix_parity import G, grouped_batch  # G completions per prompt

eight_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices "
                                   "(tests/conftest.py sets XLA_FLAGS for 8 host CPU devices)")


@pytest.mark.parametrize("window,cap,queries", [(None, None, "self"), (6, 3.0, "self"),
                                                (None, None, "after_prompt"),
                                                (5, None, "zigzag")])
@pytest.mark.slow
def test_blockwise_attention_equals_plain(window, cap, queries):
    """attention.flash (8 queries and keys per block, some pairs skipped) against the plain
    attention with the same mask as a [B, T, S] array: outputs and the gradients of q, k, v
    at every query that sees a key, with left padding, a sliding window, soft-capping, queries
    after a prompt (a shared prefix's completions) and queries in zig-zag order."""
    B, T, S, H, K, Dh = 3, 24, 24, 4, 2, 8
    q_idx = {"self": np.arange(T), "after_prompt": np.arange(T) + 8,
             "zigzag": zigzag_order(T, 2)}[queries]
    if queries == "after_prompt":
        S = T + 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((B, T, H, Dh), (B, K, S, Dh), (B, K, S, Dh)))
    key_ok = jnp.asarray(np.arange(S)[None] >= np.array([0, 5, 19])[:, None])
    mask = Mask(q_idx, key_ok, window)
    sees = np.asarray(mask.dense().any(-1))[:, :, None, None]  # [B, T, 1, 1]
    cotangent = jnp.asarray(rng.standard_normal((B, T, H, Dh)) * sees, jnp.float32)

    def plain(q, k, v):
        return decoder.attention(q, k, v, mask.dense(), 0.3, cap)

    def blockwise(q, k, v):
        return flash(q, k, v, mask, 0.3, cap, block=8)
    for f in (plain, blockwise):
        f.grads = jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
    assert np.abs((plain(q, k, v) - blockwise(q, k, v)) * sees).max() < 1e-5
    for a, b in zip(plain.grads, blockwise.grads):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5


def test_zigzag_order_balances_causal_work():
    """Each of 4 devices holds 2 of 8 chunks (i and 7 - i): the same count of (query, key)
    pairs under a causal mask, where contiguous blocks would range from 1/16 to 7/16."""
    order = zigzag_order(64, 4)
    assert sorted(order) == list(range(64))
    work = [int(np.sum(order[d * 16:(d + 1) * 16] + 1)) for d in range(4)]
    assert len(set(work)) == 1
    assert zigzag_order(60, 4) is None and zigzag_order(64, 1) is None


def test_splash_blocks_tile_long_rows():
    """Splash's blocks: the largest multiple of 128 up to the block size that divides each
    device's queries and the keys (31744 completion tokens over 4 devices: 7936 = 31 x 256),
    none where 128 does not divide them (the blockwise attention then stands in)."""
    from grpo_jax.models.attention import _tile, splash_fits
    assert _tile(7936, 512) == 256 and _tile(32768, 512) == 512 and _tile(384, 512) == 384
    assert splash_fits(31744, 32768, 512, shards=4)
    assert not splash_fits(31744 + 64, 32768, 512, shards=4) and not splash_fits(64, 64, 512)




def _laid_out(base, mesh, batch: Batch):
    """(graphdef, params, batch) of a copy of `base` laid out on `mesh` as the Policy lays it
    out: its activations constrained, its params and the batch's rows sharded."""
    model = nnx.merge(*nnx.split(base))
    model.shard_activations(mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(params, mesh_lib.param_shardings(params, mesh))
    b = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x),
                                              mesh_lib.batch_sharding(mesh, x.ndim)), batch)
    return graphdef, params, b


def _programs(base, mesh, batch: Batch, group: int, k: int):
    """(logits [N, P + C, V] in sequence order, (log-probs, entropies) [N, C], loss, gradient
    leaves) of `base` laid out on `mesh` as the Policy lays it out, with `group` rows per
    shared prompt and k accumulated micro-batches."""
    graphdef, params, b = _laid_out(base, mesh, batch)
    step = StepConfig(loss=LossConfig(vllm_importance_sampling_correction=False,
                                      loss_type="dapo", beta=0.0),
                      temperature=0.9, gradient_accumulation_steps=k, logprob_chunk=4)

    def constrain(x):  # as Policy: [k, rows, ...] splits, rows on the batch axes
        return jax.lax.with_sharding_constraint(
            x, mesh_lib.logical_sharding(mesh, None, "batch", *[None] * (x.ndim - 2)))

    def logits(p, b):
        m = nnx.merge(graphdef, p)
        ids = jnp.concatenate([b.prompt_ids, b.completion_ids], 1)
        mask = jnp.concatenate([b.prompt_mask, b.completion_mask], 1)
        order = m.sequence_order(ids.shape[1])
        out = m.logits(m(ids, positions_from_mask(mask), mask, order=order)[0])
        return out if order is None else out[:, np.argsort(order)]
    logps = jax.jit(lambda p, b: completion_logps(nnx.merge(graphdef, p), b, 0.9, 4, group))
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(graphdef, step, p, b, constrain,
                                                         group=group))(params, b)
    return (np.asarray(jax.jit(logits)(params, b)), jax.tree.map(np.asarray, logps(params, b)),
            float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)])


def _gaps(batch: Batch, want, got) -> dict:
    """Logits relative to the largest, log-probs and entropies absolute (real positions), the
    loss, and the gradients' worst leaf relative to its largest entry."""
    real = np.concatenate([batch.prompt_mask, batch.completion_mask], 1).astype(bool)
    c_real = batch.completion_mask.astype(bool)
    return {"logits": float(np.abs(got[0] - want[0])[real].max() / np.abs(want[0][real]).max()),
            "logp": float(np.abs(got[1][0] - want[1][0])[c_real].max()),
            "logp_relative": float(np.abs(got[1][0] - want[1][0])[c_real].max()
                                   / np.abs(want[1][0][c_real]).max()),
            "entropy": float(np.abs(got[1][1] - want[1][1])[c_real].max()),
            "loss": abs(got[2] - want[2]),
            "grads": max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
                         for a, b in zip(want[3], got[3]))}


TINY = ModelConfig(model_type="gemma2", vocab_size=96, hidden_size=32, intermediate_size=48,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                   sandwich_norms=True, norm_offset=True, scale_embeddings=True,
                   hidden_act="gelu_pytorch_tanh", sliding_window=5, rope_theta=1e4,
                   attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                   layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                   tie_word_embeddings=True).replace(dtype=jnp.float32, attention_block=4)


@eight_devices
@pytest.mark.slow
def test_context_axis_equals_one_device_tiny():
    """A Gemma-2-like model (sliding-window and full layers in one scan, soft-capped scores and
    logits) on a (data 1, fsdp 2, context 2, tensor 2) mesh, positions zig-zag over the context
    axis and attention by blocks of 4: forward logits, the log-probs of shared prefixes (4
    groups) and the gradients of 2 accumulated micro-batches equal one device's plain forward,
    all within 1e-5 in fp32."""
    base = Decoder(TINY, rngs=nnx.Rngs(0))
    batch = grouped_batch(TINY.vocab_size, groups=4, prompt=16, completion=16)
    one = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=2, tp=2, cp=2))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
    gaps = _gaps(batch, _programs(base, one, batch, 1, 1), _programs(base, mesh, batch, G, 2))
    assert all(v < 1e-5 for v in gaps.values()), gaps


@eight_devices
@pytest.mark.slow
def test_context_axis_equals_one_device_smollm2(smol_few_layers):
    """SmolLM2's real shapes and weights (its first 4 layers: conftest's smol_few_layers; the
    point is the context axis's code path at a real model's shapes, 9 query and 3 KV heads of
    64, Llama RoPE; the tiny test above covers the other layer kinds) on a (fsdp 2, context 4)
    mesh, zig-zag positions, 2 groups of 2 left-padded prompts with shared prefixes, 2
    accumulated micro-batches, against one device's plain forward: logits within 1e-5
    relative, the loss within 1e-6.
    Log-probs within 1e-4: fp32 summation order over all 30 layers moves them that much on one
    device alone (measured 2026-11-25 with 30 layers: shared prefix vs plain on one device
    2.5e-5; context axis vs one device 3.2e-5; logits 2.5e-6, gradients 5.9e-6 relative; on an
    AMD EPYC of family 25, Zen 3, 2026-11-28, gradients 1.4e-5 relative with the code of before
    and after that day's changes alike: gradients within 3e-5). 4 layers sum less: the bounds
    set for 30 hold."""
    smol_model = smol_few_layers
    batch = grouped_batch(smol_model.cfg.vocab_size, groups=2, prompt=16, completion=16)
    batch = batch.rows(np.r_[0:2, 4:6])  # 2 prompts x 2 completions
    one = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=2, cp=4))
    gaps = _gaps(batch, _programs(smol_model, one, batch, 1, 1),
                 _programs(smol_model, mesh, batch, 2, 2))
    assert gaps["logits"] < 1e-5 and gaps["grads"] < 3e-5 and gaps["loss"] < 1e-6, gaps
    assert gaps["logp"] < 1e-4 and gaps["entropy"] < 5e-4, gaps
    assert gaps["logp_relative"] < 1e-5, gaps  # to the largest |log-prob|: the bound


@eight_devices
@pytest.mark.slow
def test_sampler_with_cache_split_by_position():
    """The sampler on a (fsdp 2, context 4) mesh, its KV cache's slots split over the context
    axis, prompts prefilled 8 tokens at a time, against one device with unchunked prefill:
    the same tokens (greedy, and sampled with filters) and log-probs."""
    cfg = TINY.replace(sliding_window=None, layer_types=None, attn_logit_softcapping=None,
                       final_logit_softcapping=None, model_type="qwen3")
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=2, cp=4))
    prompts = [[5, 17, 30, 3, 42, 8, 9, 11, 60, 61, 62, 2], [7, 8, 9], list(range(20, 50))]
    for sp in (SamplingParams(max_completion_length=24, temperature=0, prefill_chunk_size=8),
               SamplingParams(max_completion_length=24, temperature=0.8, top_k=20,
                              stop_token_ids=(2, 3), prefill_chunk_size=8)):
        one = Sampler(cfg, dataclasses.replace(sp, prefill_chunk_size=0), pad_id=0,
                      buckets=(32,)).generate(model, prompts, 2, rng=5)
        split = Sampler(cfg, sp, pad_id=0, mesh=mesh, buckets=(32,))
        out = split.generate(model, prompts, 2, rng=5)
        for name in ("completion_ids", "completion_mask", "truncated"):
            np.testing.assert_array_equal(getattr(out, name), getattr(one, name), name)
        np.testing.assert_allclose(out.sampler_logp, one.sampler_logp, atol=1e-5)


@eight_devices
@pytest.mark.slow
def test_routing_replay_on_a_context_axis_equals_one_device():
    """Routing replay (R3) with each row's positions split over a context axis: a tiny random
    Qwen3-MoE (4 experts, 2 a token) replaying random
    experts, on a (fsdp 2, context 2, expert 2) mesh (the record zig-zag ordered with the
    tokens it belongs to), gives one device's replayed log-probs within 1e-5 in fp32, and
    router/mismatch 0 on both (the random experts are no router's own: a record left
    unreplayed, or replayed at other positions, would count). Shared prompts over the
    context axis replay the same (measured 2026-12-02) but compile three times as long."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24).replace(dtype=jnp.float32, attention_block=4, router_replay="R3")
    base = Decoder(cfg, rngs=nnx.Rngs(0))
    batch = grouped_batch(cfg.vocab_size, groups=2, prompt=16, completion=16)
    rng = np.random.default_rng(1)

    def experts(rows, width):  # k distinct random experts per token and sparse layer
        draw = rng.random((rows, width, sum(cfg.moe_layers), cfg.num_experts))
        return np.argsort(draw, axis=-1)[..., :cfg.num_experts_per_tok].astype(np.int8)
    n, P = batch.prompt_ids.shape
    batch = batch.replace(prompt_routing=np.repeat(experts(n // G, P), G, axis=0),
                          completion_routing=experts(n, batch.completion_ids.shape[1]))

    def replayed(mesh, group):
        graphdef, params, b = _laid_out(base, mesh, batch)
        logp, _, _, sums = jax.jit(lambda p, b: completion_logps_and_router(
            nnx.merge(graphdef, p), b, 0.9, 4, group))(params, b)
        return np.asarray(logp), np.asarray(sums)
    one = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=2, cp=2, ep=2))
    assert dict(mesh.shape)["context"] == 2
    (want, want_sums), (got, got_sums) = replayed(one, 1), replayed(mesh, 1)
    real = batch.completion_mask.astype(bool)
    assert want_sums[0] == got_sums[0] == 0 and want_sums[1] == got_sums[1] == 2 * real.sum()
    assert np.abs(got - want)[real].max() < 1e-5
