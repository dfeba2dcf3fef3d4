"""The sampler/trainer log-prob mismatch that vLLM's filters cause (huggingface/trl#6789), measured
against a real vLLM CPU server (vllm_server's tiny random Llama).

The server reports `processed_logprobs`: the log-prob under the distribution it sampled from,
after repetition penalty, temperature, min-p, top-k and top-p, renormalised over the kept tokens.
The trainer scores log_softmax(logits / T) over the whole vocabulary. With a filter on, each
sampled token's two log-probs differ by -log Z, Z the mass the filters kept (repetition penalty
shifts it either way), so the importance ratio exp(trainer - sampler) is Z < 1 instead of 1.
This test measures that per setting (printed; docs/vllm_weight_sync.md has the figures), checks
it against the trainer's own filters (rollout/native/sampling.py, the JAX sampler's), and checks
that VLLMRollout warns about it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import positions_from_mask
from grpo_jax.rollout.native import sampling
from vllm_server import PROMPTS, needs_vllm

SETTINGS = {"top_p=0.9": dict(top_p=0.9), "top_k=20": dict(top_k=20),
            "min_p=0.1": dict(min_p=0.1), "repetition_penalty=1.3": dict(repetition_penalty=1.3)}


def step_logits(model, prompt, completion) -> np.ndarray:
    """The trainer's raw logits for each completion token [len(completion), V]."""
    seq = jnp.array([list(prompt) + list(completion)])
    hidden, _ = model(seq, positions_from_mask(jnp.ones_like(seq)), jnp.ones_like(seq))
    return np.asarray(model.logits(hidden)[0, len(prompt) - 1:-1], np.float32)


def processed(logits, prompt, completion, temperature, top_k=0, top_p=1.0, min_p=None,
              repetition_penalty=1.0) -> np.ndarray:
    """The trainer's log-prob of each token under the sampled-from distribution (the JAX
    sampler's filters, vLLM's order: penalty, temperature, min-p, top-k/top-p)."""
    out = []
    for t, (row, tok) in enumerate(zip(logits, completion)):
        x = jnp.asarray(row)[None]
        if repetition_penalty != 1.0:
            seen = np.zeros(x.shape, bool)
            seen[0, list(prompt) + list(completion[:t])] = True
            x = sampling.apply_repetition_penalty(x, jnp.asarray(seen), repetition_penalty)
        x = sampling.filter_logits(x / temperature, min_p=min_p)
        x = sampling.filter_logits(x, top_k=top_k, top_p=top_p)
        out.append(float(jax.nn.log_softmax(x, axis=-1)[0, tok]))
    return np.float32(out)


@needs_vllm
@pytest.mark.parametrize("name", list(SETTINGS))
def test_filtered_sampler_logprobs_differ_by_kept_mass(name, client, trainer):
    kw, temperature = SETTINGS[name], 0.9
    groups = client.generate(PROMPTS, n=4, temperature=temperature, max_tokens=12, seed=5,
                             **kw)
    diffs, ratios = [], []
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            logits = step_logits(trainer, prompt, c.token_ids)
            raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits) / temperature, axis=-1))
            unfiltered = raw[np.arange(len(c.token_ids)), c.token_ids]
            got = np.float32(c.logprobs)
            # The server's log-probs are the filtered distribution's, as the trainer computes it.
            np.testing.assert_allclose(got, processed(logits, prompt, c.token_ids, temperature,
                                                      **kw), atol=1e-4, rtol=0)
            diffs.append(got - unfiltered)
            ratios.append(np.exp(unfiltered - got))
    d, r = np.concatenate(diffs), np.concatenate(ratios)
    print(f"{name}, T={temperature}: sampler - trainer log-prob per token mean {d.mean():.4f}, "
          f"max {d.max():.4f}; importance ratio mean {r.mean():.4f}, min {r.min():.4f}")
    assert np.abs(d).max() > 1e-2  # the filters do change the log-probs: a real mismatch
    if "repetition" not in name:  # truncation only ever removes mass: sampler >= trainer
        assert d.min() > -1e-4


@needs_vllm
def test_vllm_rollout_warns_about_filters(server, model_dir, capsys):
    import dataclasses

    from grpo_jax.config import TrainConfig
    from grpo_jax.hf import load_model
    from grpo_jax.rollout.engines import make_rollout
    from vllm_server import API_KEY
    cfg = TrainConfig()
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, backend="vllm", vllm_server_api_key=API_KEY,
                                         vllm_server_base_url=server.base_url),
        generation=dataclasses.replace(cfg.generation, top_p=0.9, max_completion_length=8),
        data=dataclasses.replace(cfg.data, max_prompt_length=64))
    tok = type("Tok", (), {"eos_token_id": 2, "pad_token_id": 0})()
    make_rollout(cfg, load_model(str(model_dir))[0].cfg, tok, None, model_dir)
    err = capsys.readouterr().err
    assert "top_p" in err and "importance" in err and "docs/vllm_weight_sync.md" in err, err
