"""The decoder against transformers (PyTorch CPU, fp32): logits, export round trip, errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_oracle import hf_logits, tiny_hf_model

from grpo_jax import hf
from grpo_jax.models import positions_from_mask

TOKENS = np.array([[0, 0, 0, 5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14],
                   [0, 0, 0, 0, 0, 0, 120, 6]])
MASK = (np.arange(8)[None] >= np.array([3, 0, 6])[:, None]).astype(np.int32)


def jax_logits(model, tokens=TOKENS, mask=MASK):
    hidden, _ = model(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)),
                      jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


def _max_diff_real(a, b, mask=MASK):
    return np.abs(a - b)[mask.astype(bool)].max()


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False),
                                        ("qwen2", True), ("qwen3", False)])
def test_logits_match_transformers_left_padded(tmp_path, family, tie):
    ref = tiny_hf_model(family, tie=tie)
    ref.save_pretrained(tmp_path)
    model, _ = hf.load_model(str(tmp_path), dtype=jnp.float32)
    assert _max_diff_real(jax_logits(model), hf_logits(ref, TOKENS, MASK)) < 1e-4


def test_llama3_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    ref = tiny_hf_model("llama", rope_parameters=rope)
    ref.save_pretrained(tmp_path)
    model, _ = hf.load_model(str(tmp_path), dtype=jnp.float32)
    assert model.cfg.rope_llama3 is not None
    assert _max_diff_real(jax_logits(model), hf_logits(ref, TOKENS, MASK)) < 1e-4


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False)])
def test_export_round_trip(tmp_path, family, tie):
    import transformers
    src = tiny_hf_model(family, tie=tie, seed=3)
    src.save_pretrained(tmp_path / "src")
    model, _ = hf.load_model(str(tmp_path / "src"), dtype=jnp.float32)
    hf.save_hf(model, tmp_path / "out", source_dir=tmp_path / "src")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert _max_diff_real(jax_logits(model), hf_logits(back, TOKENS, MASK)) < 1e-4


def test_sharded_export_and_bf16(tmp_path):
    import transformers
    src = tiny_hf_model("llama", seed=4)
    src.save_pretrained(tmp_path / "src")
    model, _ = hf.load_model(str(tmp_path / "src"), dtype=jnp.float32)
    hf.save_hf(model, tmp_path / "out", dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                             dtype="float32").eval()
    reloaded, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert _max_diff_real(jax_logits(reloaded), hf_logits(back, TOKENS, MASK)) < 1e-4


def test_refuses_pickle_checkpoints(tmp_path):
    import torch
    src = tiny_hf_model("llama")
    src.config.save_pretrained(tmp_path)
    torch.save(src.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(hf.ModelLoadError, match="pickle.*safe_serialization=True"):
        hf.load_model(str(tmp_path))


def test_bad_model_inputs(tmp_path):
    with pytest.raises(hf.ModelLoadError, match="not found"):
        hf.load_model(str(tmp_path / "nope"))
    with pytest.raises(hf.ModelLoadError, match="no config.json"):
        hf.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(hf.ModelLoadError, match="unsupported model_type 'gpt2'"):
        hf.load_model(str(tmp_path))


def test_hub_id_offline_fails_with_advice():
    with pytest.raises(hf.ModelLoadError, match="hub.*--local-dir"):
        hf.load_model("someorg/somemodel-that-is-not-cached")


@pytest.mark.slow
def test_real_smollm2_matches_transformers(smol_tok, smol_ref, smol_model):
    tok, ref, model = smol_tok, smol_ref, smol_model
    assert (model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.tie_word_embeddings) == (
        30, 3, True)
    chats = [[{"role": "user", "content": "What is 2+3?"}],
             [{"role": "user", "content": "Summarise: the cat sat on the mat all day."}]]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    width = max(map(len, ids))
    tokens = np.array([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
    mask = np.array([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    got = jax_logits(model, tokens, mask)
    want = hf_logits(ref, tokens, mask)
    # 30 fp32 layers, logits up to |38|: measured 1.0e-4 absolute, i.e. ~3e-6 relative.
    assert _max_diff_real(got, want, mask) < 2e-4
    assert np.abs(got - want)[mask.astype(bool)].mean() < 2e-5
    # It is a real chat model: the next token after the prompt is the same in both.
    last = mask.shape[1] - 1
    assert (got[:, last].argmax(-1) == want[:, last].argmax(-1)).all()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_kv_cache_path_matches_full_forward(tmp_path, family):
    """Prefill 5 tokens into a cache, then feed the other 3 one at a time: the hidden states
    equal one causal pass over all 8."""
    from grpo_jax.models import KVCache
    tiny_hf_model(family, seed=1).save_pretrained(tmp_path)
    model, _ = hf.load_model(str(tmp_path), dtype=jnp.float32)
    tokens, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)
    positions = positions_from_mask(mask)
    full, _ = model(tokens, positions, mask)
    layers = model.decode_layers()
    cache = KVCache.zeros(model.cfg, 3, 10, jnp.float32)
    slots = jnp.pad(mask, ((0, 0), (0, 2)))  # two slots never written nor attended
    out, cache = model(tokens[:, :5], positions[:, :5], slots, cache=cache, cache_index=0,
                       layers=layers)
    steps = [out]
    for t in range(5, 8):
        out, cache = model(tokens[:, t:t + 1], positions[:, t:t + 1], slots, cache=cache,
                           cache_index=t, layers=layers)
        steps.append(out)
    got = np.asarray(jnp.concatenate(steps, axis=1))
    real = MASK.astype(bool)
    assert np.abs(got - np.asarray(full))[real].max() < 1e-5
    assert np.asarray(cache.k[0])[:, :, 8:].max() == 0  # unwritten slots stay empty


def test_remat_policies_give_the_same_gradient(tmp_path):
    import jax
    from flax import nnx
    tiny_hf_model("qwen2", seed=2).save_pretrained(tmp_path)
    grads = {}
    for name, kw in [("none", dict(remat=False)), ("full", dict(remat_policy="full")),
                     ("dots", dict(remat_policy="dots"))]:
        model, _ = hf.load_model(str(tmp_path), dtype=jnp.float32, **kw)
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            m = nnx.merge(graphdef, p)
            hidden, _ = m(jnp.asarray(TOKENS), positions_from_mask(jnp.asarray(MASK)),
                          jnp.asarray(MASK))
            return jnp.sum(jax.nn.log_softmax(m.logits(hidden))[..., 3] * MASK)
        grads[name] = jax.tree.leaves(jax.grad(loss)(params))
    for name in ("full", "dots"):
        for a, b in zip(grads["none"], grads[name]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

