"""The native JAX sampler against transformers (generate, logits warpers; PyTorch CPU, fp32), a
full-sequence forward pass (the trainer's log-probs) and numpy re-derivations of the filters."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_oracle import tiny_hf_model
from model_oracle import trainer_logp
from transformers.generation import logits_process as lp

from grpo_jax import hf
from grpo_jax.config import TrainConfig
from grpo_jax import mesh as mesh_lib
from grpo_jax.models import Decoder, ModelConfig
from grpo_jax.rollout import RolloutBatch, Sampler, SamplingParams
from grpo_jax.rollout.native import sampling
from grpo_jax.rollout.engines import make_rollout

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [120, 6, 3]]
C = 12
STOPS = tuple(range(2, 20))  # many stop ids: sampled rows end at different lengths
SAMPLER_PROGRAM = "jit(_generate)"  # the name XLA compiles Sampler's program under


def _load(tmp_path, family, tie=False, seed=0):
    ref = tiny_hf_model(family, tie=tie, seed=seed)
    path = tmp_path / f"{family}-{seed}"
    ref.save_pretrained(path)
    model, _ = hf.load_model(str(path), dtype=jnp.float32)
    return ref, model


def hf_generate(ref, prompts, max_new_tokens, eos, pad=0, **kw):
    """transformers greedy generate on a left-padded batch -> [N, max_new_tokens], pad after EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                           pad_token_id=pad, **kw)
    out = out[:, width:].numpy()
    return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])), constant_values=pad)


def _expected_mask(tokens, stops):
    """1 up to and including the first stop token (numpy re-derivation)."""
    is_stop = np.isin(tokens, stops)
    before = np.cumsum(is_stop, axis=1) - is_stop
    return (before == 0).astype(np.int32), ~is_stop.any(axis=1)


def _check_layout(out: RolloutBatch, prompts, num_generations, stops, pad=0):
    n = len(prompts) * num_generations
    assert out.prompt_ids.shape == out.prompt_mask.shape == (n, 32)
    assert out.completion_ids.shape == out.completion_mask.shape == out.sampler_logp.shape
    for i, p in enumerate(prompts):
        for r in range(i * num_generations, (i + 1) * num_generations):  # group blocks
            assert out.prompt_ids[r, -len(p):].tolist() == list(p)
            assert out.prompt_mask[r].tolist() == [0] * (32 - len(p)) + [1] * len(p)
    mask, truncated = _expected_mask(out.completion_ids, stops)
    np.testing.assert_array_equal(out.completion_mask, mask)
    np.testing.assert_array_equal(out.truncated, truncated)
    assert (out.completion_ids[mask == 0] == pad).all()
    assert (out.sampler_logp[mask == 0] == 0).all()


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_greedy_matches_transformers_and_weight_swap_does_not_recompile(tmp_path, family, tie,
                                                                        compiled):
    ref, model = _load(tmp_path, family, tie)
    # A stop token the model really emits (row 0's 5th greedy token unless it is the pad id).
    row0 = hf_generate(ref, PROMPTS, C, eos=(2,))[0]
    stops = (2, int(next(t for t in row0[4:] if t != 0)))
    want = hf_generate(ref, PROMPTS, C, eos=stops)
    sampler = Sampler(model.cfg, SamplingParams(max_completion_length=C, temperature=0,
                                                stop_token_ids=stops), pad_id=0)
    out = sampler.generate(model, PROMPTS)
    np.testing.assert_array_equal(out.completion_ids, want)
    assert not out.truncated[0]
    _check_layout(out, PROMPTS, 1, stops)

    # New weights (as an nnx.State), other prompt lengths in the same bucket, 4 rows (the same
    # batch bucket): same program, outputs follow the new weights. (The program is one per
    # num_generations too: it prefills each prompt once; test_prefill_once_per_prompt_...)
    ref2, model2 = _load(tmp_path, family, tie, seed=1)
    prompts2 = [[9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                [4, 4], [30, 31, 32, 33]]
    out2 = sampler.generate(nnx.split(model2, nnx.Param)[1], prompts2)
    np.testing.assert_array_equal(out2.completion_ids, hf_generate(ref2, prompts2, C, eos=stops))
    _check_layout(out2, prompts2, 1, stops)
    assert compiled.count(SAMPLER_PROGRAM) == 1, compiled


def test_repetition_penalty_matches_transformers(tmp_path):
    ref, model = _load(tmp_path, "llama")
    # Equal lengths: transformers would also penalise the pad id inside left-padded prompts.
    prompts = [[5, 17, 99, 3, 42, 5], [7, 8, 9, 10, 11, 12], [120, 6, 3, 6, 6, 100]]
    want = hf_generate(ref, prompts, C, eos=(2,), repetition_penalty=1.5)
    assert (want != hf_generate(ref, prompts, C, eos=(2,))).any()  # the penalty matters here
    sp = SamplingParams(max_completion_length=C, temperature=0, repetition_penalty=1.5,
                        stop_token_ids=(2,))
    out = Sampler(model.cfg, sp, pad_id=0).generate(model, prompts)
    np.testing.assert_array_equal(out.completion_ids, want)


@pytest.mark.slow
def test_sampled_logp_equals_trainer_and_seeds(tmp_path, compiled):
    _, model = _load(tmp_path, "qwen2", tie=True)
    sp = SamplingParams(max_completion_length=C, temperature=0.7, stop_token_ids=STOPS)
    sampler = Sampler(model.cfg, sp, pad_id=0)
    prompts = PROMPTS[:2]
    out = sampler.generate(model, prompts, num_generations=4, rng=3)
    _check_layout(out, prompts, 4, STOPS)
    assert out.truncated.any() and not out.truncated.all()
    assert len({tuple(r) for r in out.completion_ids[:4]}) > 1  # a group's samples differ
    m = out.completion_mask.astype(bool)
    assert np.abs(out.sampler_logp - trainer_logp(model, out, 0.7))[m].max() < 1e-4

    again = sampler.generate(model, prompts, num_generations=4, rng=3)
    for a, b in zip(out, again):
        np.testing.assert_array_equal(a, b)
    other = sampler.generate(model, prompts, num_generations=4, rng=jax.random.key(4))
    assert (other.completion_ids != out.completion_ids).any()
    assert compiled.count(SAMPLER_PROGRAM) == 1, compiled


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
@pytest.mark.slow
def test_prefill_once_per_prompt_gives_the_same_tokens(tmp_path, mesh_shape):
    """A group's prompt is prefilled once and its cache copied to the group's rows: the same
    tokens and log-probs as prefilling every row (each row its own prompt; rows draw from the
    same per-row keys), with repetition penalty and filters on, 3 prompts x 3 (rows padded to
    a power of two), on one device and on a (2, 2, 2) mesh."""
    mesh = mesh_shape and mesh_lib.make_mesh(mesh_lib.MeshConfig(*mesh_shape), jax.devices()[:8])
    _, model = _load(tmp_path, "qwen2", tie=True)
    sp = SamplingParams(max_completion_length=C, temperature=0.9, top_k=40, min_p=0.01,
                        repetition_penalty=1.3, stop_token_ids=STOPS)
    sampler = Sampler(model.cfg, sp, pad_id=0, mesh=mesh)
    shared = sampler.generate(model, PROMPTS, num_generations=3, rng=11)
    each_row = sampler.generate(model, [p for p in PROMPTS for _ in range(3)], 1, rng=11)
    _check_layout(shared, PROMPTS, 3, STOPS)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        np.testing.assert_array_equal(getattr(shared, name), getattr(each_row, name), name)
    # Measured: equal to the last bit on XLA:CPU; the bound allows kernel-blocking noise.
    np.testing.assert_allclose(shared.sampler_logp, each_row.sampler_logp, atol=1e-6)
    assert len({tuple(r) for r in shared.completion_ids[:3]}) > 1  # the group's rows differ


@pytest.mark.slow
def test_mesh_matches_single_device(tmp_path):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2), devices[:8])
    _, model = _load(tmp_path, "llama")
    for sp in (SamplingParams(max_completion_length=C, temperature=0, stop_token_ids=(2,)),
               SamplingParams(max_completion_length=C, temperature=0.7, top_k=50, top_p=0.95,
                              stop_token_ids=STOPS)):
        one = Sampler(model.cfg, sp, pad_id=0).generate(model, PROMPTS, 2, rng=7)
        sharded = Sampler(model.cfg, sp, pad_id=0, mesh=mesh).generate(model, PROMPTS, 2, rng=7)
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                     "truncated"):
            np.testing.assert_array_equal(getattr(sharded, name), getattr(one, name), name)
        np.testing.assert_allclose(sharded.sampler_logp, one.sampler_logp, atol=1e-5)


# ---------------------------------------------------------------- the pure sampling functions

FILTERS = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2),
           dict(top_k=12, top_p=0.9, min_p=0.05)]


def _hf_filtered(logits, temperature, top_k=0, top_p=1.0, min_p=None):
    scores = torch.tensor(logits)
    warpers = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(lp.TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(lp.MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(None, scores)
    return scores.numpy()


@pytest.mark.parametrize("kw", FILTERS)
def test_filters_match_transformers_warpers(kw):
    logits = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32) * 3
    want = _hf_filtered(logits, 0.7, **kw)
    got = np.asarray(sampling.filter_logits(jnp.asarray(logits) / 0.7, **kw))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)


def test_repetition_penalty_matches_transformers_processor():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 32)).astype(np.float32)
    ids = rng.integers(0, 32, size=(4, 10))
    want = lp.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), torch.tensor(logits))
    seen = np.zeros((4, 32), bool)
    np.put_along_axis(seen, ids, True, axis=1)
    got = sampling.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), 1.3)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)


def _allowed_probs(logits, temperature, top_k=0, top_p=1.0, min_p=None):
    """numpy: the renormalised distribution that top-k, then top-p, then min-p leave."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.ones_like(probs, bool)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1:
        p = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
        mass_above = np.cumsum(p[order]) - p[order]
        keep[order[mass_above >= top_p]] = False
    if min_p:
        keep &= probs >= min_p * probs.max()
    out = np.where(keep, probs, 0)
    return out / out.sum()


@pytest.mark.parametrize("kw", [{}] + FILTERS)
def test_draws_stay_in_allowed_set_with_right_frequencies(kw):
    logits = np.random.default_rng(2).normal(size=32).astype(np.float32) * 2
    n = 8192
    want = _allowed_probs(logits, 0.7, **kw)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0), jnp.arange(n))
    sp = SamplingParams(temperature=0.7, **kw)
    tokens, logp = sampling.sample(keys, jnp.tile(jnp.asarray(logits), (n, 1)), sp)
    tokens = np.asarray(tokens)
    assert (want[tokens] > 0).all(), "a token outside the allowed set was drawn"
    freq = np.bincount(tokens, minlength=32) / n
    assert np.abs(freq - want).max() < 0.03  # ~5 standard deviations at n = 8192
    full = logits / 0.7 - np.log(np.exp(logits / 0.7).sum())
    np.testing.assert_allclose(np.asarray(logp), full[tokens], atol=1e-5)


def test_greedy_sample_is_argmax_with_untempered_logp():
    logits = np.random.default_rng(3).normal(size=(5, 40)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 5)
    tokens, logp = sampling.sample(keys, jnp.asarray(logits), SamplingParams(temperature=0))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    log_norm = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(np.asarray(logp), logits.max(-1) - log_norm, atol=1e-5)


# ---------------------------------------------------------------- bad input

def test_bad_input_errors(compiled):
    with pytest.raises(ValueError, match="temperature=-1.*>= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p=0.*\(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k=-2"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="repetition_penalty=0"):
        SamplingParams(repetition_penalty=0)
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    sp = SamplingParams(max_completion_length=4, stop_token_ids=[2])
    with pytest.raises(ValueError, match="pad_id=64"):
        Sampler(cfg, sp, pad_id=64)
    with pytest.raises(ValueError, match=r"stop_token_ids \[99\]"):
        Sampler(cfg, SamplingParams(stop_token_ids=(99,)), pad_id=0)
    sampler = Sampler(cfg, sp, pad_id=0, buckets=(8,))
    params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)[1]
    other = nnx.split(nnx.eval_shape(lambda: Decoder(cfg.replace(num_layers=2),
                                                     rngs=nnx.Rngs(0))), nnx.Param)[1]
    with pytest.raises(ValueError, match="params do not match"):
        sampler.generate(other, [[1, 2]])
    with pytest.raises(ValueError, match="non-empty list"):
        sampler.generate(params, [])
    with pytest.raises(ValueError, match="tokenize it first"):
        sampler.generate(params, ["hello"])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate(params, [[1], []])
    with pytest.raises(ValueError, match=r"outside \[0, 64\)"):
        sampler.generate(params, [[1, 64]])
    with pytest.raises(ValueError, match=r"9 tokens exceeds the largest bucket 8.*16"):
        sampler.generate(params, [list(range(9))])
    with pytest.raises(ValueError, match="num_generations=0"):
        sampler.generate(params, [[1]], num_generations=0)
    assert SAMPLER_PROGRAM not in compiled, compiled


@pytest.mark.parametrize("gen_eos,want", [([7, 9], (2, 7, 9, 5)), (9, (2, 9, 5)),
                                          ([2, 5], (2, 5)), (None, (2, 5)), ("absent", (2, 5))])
def test_stop_tokens_add_generation_config_eos(tmp_path, gen_eos, want):
    """TRL stops on the tokenizer's EOS plus every generation_config.eos_token_id (an int or a
    list), then the config's own stop_token_ids."""
    if gen_eos != "absent":
        (tmp_path / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": gen_eos}))
    cfg = dataclasses.replace(TrainConfig(), generation=SamplingParams(stop_token_ids=(5,)))
    model_cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    rollout = make_rollout(cfg, model_cfg, tok, None, tmp_path)
    assert rollout.sampler.sampling_params.stop_token_ids == want


# ---------------------------------------------------------------- the real model

@pytest.mark.slow
def test_real_smollm2_greedy_matches_transformers(smol_tok, smol_ref, smol_model):
    tok, ref, model = smol_tok, smol_ref, smol_model
    chats = ["What is 2+3?", "Name a colour of the sky.",
             "Write one short sentence about cats."]
    prompts = []
    for c in chats:
        ids = tok.apply_chat_template([{"role": "user", "content": c}],
                                      add_generation_prompt=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    stops, pad = (tok.eos_token_id,), tok.pad_token_id
    want = hf_generate(ref, prompts, 24, eos=stops, pad=pad)
    sp = SamplingParams(max_completion_length=24, temperature=0, stop_token_ids=stops)
    out = Sampler(model.cfg, sp, pad_id=pad).generate(model, prompts)
    np.testing.assert_array_equal(out.completion_ids, want)
    assert "5" in tok.decode(out.completion_ids[0][out.completion_mask[0] == 1])
