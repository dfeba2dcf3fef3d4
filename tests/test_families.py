"""Mistral, Phi-3, Gemma 2 and Gemma 3 against transformers (PyTorch CPU, fp32): logits on a
left-padded batch longer than the sliding window, the KV-cache path (a ring for sliding
layers) and greedy generation, export back to a directory transformers loads, and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_oracle import hf_greedy, hf_logits, tiny_hf_model
from model_oracle import LONG_MASK, LONG_TOKENS, decode_step, long_diff, long_logits

from grpo_jax import hf
from grpo_jax.models import KVCache, ModelConfig, ModelConfigError, positions_from_mask
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

NEW = ["mistral", "phi3", "gemma2", "gemma3_text"]


def _load(tmp_path, family, seed=0, **kw):
    ref = tiny_hf_model(family, seed=seed, **kw)
    ref.save_pretrained(tmp_path / f"{family}-{seed}")
    model, _ = hf.load_model(str(tmp_path / f"{family}-{seed}"), dtype=jnp.float32)
    return ref, model


@pytest.mark.parametrize("family", NEW)
def test_logits_match_transformers(tmp_path, family):
    ref, model = _load(tmp_path, family)
    assert model.cfg.model_type == family
    assert long_diff(long_logits(model), hf_logits(ref, LONG_TOKENS, LONG_MASK)) < 1e-4


def test_the_switches_matter(tmp_path):
    """Each Gemma switch changes the logits, so the parity above tests it."""
    ref, model = _load(tmp_path, "gemma2")
    base = long_logits(model)
    cfg = model.cfg
    for change in (dict(sliding_window=None, layer_types=None), dict(attn_logit_softcapping=None),
                   dict(final_logit_softcapping=None), dict(query_pre_attn_scalar=None),
                   dict(norm_offset=False), dict(scale_embeddings=False)):
        model.cfg = cfg.replace(**change)
        assert long_diff(long_logits(model), base) > 1e-3, change
    model.cfg = cfg


@pytest.mark.parametrize("family", NEW)
@pytest.mark.slow
def test_kv_cache_path_matches_full_forward(tmp_path, family):
    """Prefill 5 tokens, then decode the rest one at a time: the sliding layers' ring buffers
    (window 4 or 5 slots for 12 positions) wrap, and every step's logits equal the full
    forward's at that position, with the layers scanned (runs of like layers: Gemma 3's two
    sliding ones, Mistral's and Phi-3's all) and unrolled."""
    _, model = _load(tmp_path, family)
    full = long_logits(model)
    for layers in ("scan", "unroll"):
        model.cfg = cfg = model.cfg.replace(sampler_layers=layers)
        S, P = LONG_TOKENS.shape[1], 5
        cache = KVCache.zeros(cfg, len(LONG_TOKENS), P)
        assert len(cache.k) == (cfg.num_layers if layers == "unroll" else
                                {"gemma2": 3, "gemma3_text": 2}.get(family, 1))
        assert {c.shape[3] for c, (first, _) in zip(cache.k, cfg.cache_runs())
                if cfg.sliding_layers[first]} <= {4, 5}
        mask = jnp.asarray(LONG_MASK)
        pos = positions_from_mask(mask)
        hidden, cache = model(jnp.asarray(LONG_TOKENS[:, :P]), pos[:, :P], mask[:, :P],
                              cache=cache, cache_index=0)
        steps = [model.logits(hidden)]
        cache = cache.grown(cfg, S)
        for t in range(P, S):  # one compiled step for all of them (the index traced)
            hidden, cache = decode_step(model, jnp.asarray(LONG_TOKENS[:, t:t + 1]),
                                        pos[:, t:t + 1], mask, cache, jnp.int32(t))
            steps.append(model.logits(hidden))
        got = np.asarray(jnp.concatenate(steps, axis=1))
        assert long_diff(got, full) < 1e-4, layers


@pytest.mark.parametrize("family", NEW)
def test_greedy_generation_matches_transformers(tmp_path, family):
    """Prompts longer than the window and 12 new tokens: the rings wrap several times."""
    ref, model = _load(tmp_path, family)
    prompts = [[5, 17, 99, 3, 42, 8, 77], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [120, 6]]
    sp = SamplingParams(max_completion_length=12, temperature=0, stop_token_ids=(2,))
    out = Sampler(model.cfg, sp, pad_id=0, buckets=(16,)).generate(model, prompts)
    np.testing.assert_array_equal(out.completion_ids, hf_greedy(ref, prompts, 12))


@pytest.mark.parametrize("family", NEW)
def test_export_round_trip(tmp_path, family):
    ref, model = _load(tmp_path, family, seed=3)
    hf.save_hf(model, tmp_path / "out", source_dir=tmp_path / f"{family}-3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(ref)
    assert long_diff(long_logits(model), hf_logits(back, LONG_TOKENS, LONG_MASK)) < 1e-4
    again, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert again.cfg == model.cfg


def test_phi3_fused_tensors_split_and_join(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: loading splits them by rows, export joins them."""
    ref, model = _load(tmp_path, "phi3")
    sd = ref.state_dict()
    wq = np.asarray(model.layers.wq[...])[1].reshape(64, -1).T
    np.testing.assert_array_equal(wq, sd["model.layers.1.self_attn.qkv_proj.weight"][:64])
    ours = hf.hf_state_dict(model.cfg, hf.params_numpy(model))
    assert set(ours) == set(sd)
    for k in ours:
        np.testing.assert_array_equal(ours[k], sd[k].numpy(), err_msg=k)


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: their text_config and
    model.language_model.* tensors are the decoder; its text-only logits are the oracle."""
    text = tiny_hf_model("gemma3_text", tie=True).config
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "mm")
    model, _ = hf.load_model(str(tmp_path / "mm"), dtype=jnp.float32)
    assert model.cfg.model_type == "gemma3_text" and model.cfg.num_layers == 3
    assert long_diff(long_logits(model), hf_logits(ref, LONG_TOKENS, LONG_MASK)) < 1e-4
    hf.save_hf(model, tmp_path / "out", source_dir=tmp_path / "mm")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert long_diff(long_logits(model), hf_logits(back, LONG_TOKENS, LONG_MASK)) < 1e-4


def test_transformers_4_gemma_configs():
    """Older config.json files imply the layer types and spell RoPE the old way."""
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=6,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4)
    g2 = ModelConfig.from_hf({**base, "model_type": "gemma2", "rope_theta": 10000.0})
    assert g2.layer_types[:2] == ("sliding_attention", "full_attention")
    g3 = ModelConfig.from_hf({"model_type": "gemma3", "text_config": {
            **base, "model_type": "gemma3_text", "rope_theta": 1e6,
            "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}})
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_linear) == (1e6, 1e4, 8.0)
    assert g3.tie_word_embeddings and g3.norm_offset and g3.qk_norm


@pytest.mark.parametrize("hf_cfg,match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     r"unsupported model_type 'gpt2'.*supports llama, mistral, phi3, qwen2, qwen3, gemma2, "
     r"gemma3_text, gemma3"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope"}}, "longrope"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"model_type": "llama", "hidden_act": "relu"}, "hidden_act 'relu'"),
])
def test_unsupported_configs_say_what_is(hf_cfg, match):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2)
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf({**base, **hf_cfg})


def test_gemma2_trains_like_its_grads(tmp_path):
    """The train step's log-probs apply the final soft-cap like Decoder.logits does."""
    from grpo_jax.grpo.logprobs import token_logprobs
    _, model = _load(tmp_path, "gemma2")
    hidden, _ = model(jnp.asarray(LONG_TOKENS), positions_from_mask(jnp.asarray(LONG_MASK)),
                      jnp.asarray(LONG_MASK))
    targets = jnp.asarray(np.roll(LONG_TOKENS, -1, axis=1))
    logp, _ = token_logprobs(hidden, model.head_weight(), targets, 0.7, chunk_size=5,
                             softcap=model.cfg.final_logit_softcapping)
    want = jax.nn.log_softmax(model.logits(hidden) / 0.7, axis=-1)
    want = jnp.take_along_axis(want, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
@pytest.mark.slow
def test_grpo_run_on_a_gemma_policy(tmp_path, family):
    """Two GRPO steps with a tiny Gemma policy, fsdp over 4 devices, prompts longer than its
    window: the sampler's log-probs (ring cache, soft-caps) equal the train step's."""
    from hf_oracle import char_tokenizer, tiny_grpo_run
    model = tiny_hf_model(family, tie=True, vocab=len(char_tokenizer()))
    last = tiny_grpo_run(tmp_path, model, dp=1, fsdp=4)
    assert np.isfinite(last["loss"])
    assert last["sampling/sampling_logp_difference/max"] < 1e-4


def test_lora_on_phi3_is_refused(tmp_path):
    from grpo_jax.errors import GrpoJaxError
    from grpo_jax.models import lora
    _, model = _load(tmp_path, "phi3")
    with pytest.raises(GrpoJaxError, match="LoRA on Phi-3"):
        lora.add_adapters(model, lora.PeftArgs(use_peft=True), jax.random.key(0))
