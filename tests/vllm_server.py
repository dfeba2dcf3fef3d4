"""The vLLM CPU server of the vLLM tests: its settings (API key, environment, compile cache), the
tiny random Llama it serves, the trainer's log-probs to check it against, and the settings of a
short GRPO run with vLLM rollouts. The shared servers and the module fixtures over them
(`model_dir`, `trainer`, `server`, `client`) are conftest.py's.

Needs the vLLM venv: `.ci/install_vllm.sh DIR`, then GRPO_JAX_VLLM_PYTHON=DIR/bin/python.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.hf import load_model, params_numpy
from grpo_jax.models import positions_from_mask

VLLM_PYTHON = os.environ.get("GRPO_JAX_VLLM_PYTHON")
SKIP_WITHOUT_VLLM = pytest.mark.skipif(
    not VLLM_PYTHON, reason="GRPO_JAX_VLLM_PYTHON is unset: install the vLLM CPU server with "
    "`.ci/install_vllm.sh DIR` and set it to DIR/bin/python")


def needs_vllm(test):
    return pytest.mark.slow(pytest.mark.vllm(SKIP_WITHOUT_VLLM(test)))


VOCAB, PAD, EOS = 512, 0, 2
API_KEY = "test-key-not-secret"


def tiny_llama(out_dir):
    """A random tied-embedding Llama with a word-level tokenizer (vLLM needs one in the dir).
    hidden 128 / 4 heads: vLLM's CPU attention has no kernel for head_dim 16."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": EOS, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>").save_pretrained(out_dir)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
        rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than the default init, so log-probs vary by whole nats
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


def run_tiny_llama() -> Path:
    """tiny_llama in the run's directory (tests/conftest.py), made by the first process that
    asks (the others wait on the lock)."""
    import fcntl
    run = Path(os.environ["GRPO_JAX_TEST_RUN_DIR"])
    out = run / "tiny_llama"
    with open(run / "tiny_llama.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            tiny_llama(out)
            (out / "done").touch()
    return out


def server_env(**extra) -> dict:
    """A vLLM server's environment: the run's compile cache (vLLM saves its artifacts
    atomically, and a server that finds its model's loads them)."""
    cache = Path(os.environ["GRPO_JAX_TEST_RUN_DIR"]) / "vllm-cache"
    return dict(os.environ, **{"VLLM_CACHE_ROOT": str(cache), **extra})


# vLLM's own switch for its CPU CI: the model is still traced by dynamo once, as served, but run
# by the eager backend instead of inductor's generated C++ (minutes of cc1plus per model on 2
# cores). For a server that can't load compiled artifacts from the run's cache (SmolLM2's keeps a
# cache of its own): healthy after 56 s instead of 157-232 s beside a running suite (2026-12-02).
# The tiny Llama's servers keep inductor: the first compiles, the later ones load its artifacts,
# and test_vllm_async's seeded 20-step reward rise is a trajectory of inductor's numerics (eager
# sampled another one, whose async rise was 0.039 against the check's 0.05).
NO_INDUCTOR = {"VLLM_CPU_CI_ENV": "1"}


def start_vllm(model_dir, tmp, max_model_len, **env):
    """grpo_jax.serve's server for `model_dir`, guarded by API_KEY, its log in `tmp`, once
    healthy (a test without the vLLM venv is skipped)."""
    import time

    from grpo_jax import serve
    from grpo_jax.rollout.vllm.client import VLLMClient
    if not VLLM_PYTHON:
        pytest.skip("GRPO_JAX_VLLM_PYTHON is unset")
    srv = serve.start_server(model_dir, free_port(), python=VLLM_PYTHON,
                             max_model_len=max_model_len, api_key=API_KEY,
                             log_path=tmp / "server.log", env=server_env(**env))
    try:
        start = time.monotonic()
        VLLMClient(srv.base_url).wait_healthy(timeout=600, server=srv)
        print(f"vLLM server healthy after {time.monotonic() - start:.0f} s")
    except BaseException:
        srv.stop()
        raise
    return srv


def push_initial_weights(base_url: str, model_dir) -> None:
    """Give a server the weights of `model_dir` back (a run before trained it)."""
    from grpo_jax.rollout.vllm.client import VLLMClient
    model, _ = load_model(str(model_dir), dtype=jnp.float32)
    with VLLMClient(base_url, api_key=API_KEY) as c:
        c.sync_weights(model.cfg, params_numpy(model))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_logp(model, prompt, completion, temperature=1.0):
    """log_softmax(logits / T) of each completion token from the JAX model (fp32)."""
    seq = jnp.array([list(prompt) + list(completion)])
    mask = jnp.ones_like(seq)
    hidden, _ = model(seq, positions_from_mask(mask), mask)
    lp = jax.nn.log_softmax(model.logits(hidden)[0, :-1] / temperature, axis=-1)
    return jnp.take_along_axis(lp, seq[0, 1:, None], axis=-1)[len(prompt) - 1:, 0]


def trainer_logp(model, prompt, completion, temperature=1.0):
    return np.asarray(token_logp(model, prompt, completion, temperature))


PROMPTS = [[1, 17, 250, 33, 9], [1, 400, 401], [1, 5, 6, 7, 8, 9, 10, 11]]
COMPLETIONS = [[60, 61, 62, 2], [300, 12, 499, 7, 7, 7], [100]]


# ------------------------------------------------------------------ the training program

def train_config(model_dir, out, base_url, **extra):
    import json as _json
    from pathlib import Path

    from grpo_jax.cli import load_config
    prompts = Path(out).parent / "prompts.jsonl"
    rng = np.random.default_rng(0)
    with open(prompts, "w") as f:
        for _ in range(32):
            words = " ".join(f"w{t}" for t in rng.integers(4, VOCAB, rng.integers(3, 9)))
            f.write(_json.dumps({"prompt": words}) + "\n")
    fixtures = Path(__file__).parent / "reward_fixtures.py"
    sets = {"name_or_path": str(model_dir), "dtype": "float32", "dataset_name": str(prompts),
            "reward_funcs": f"[{fixtures}:even_tokens]", "num_generations": 4,
            "max_completion_length": 8, "per_device_train_batch_size": 8, "dp": 1,
            "learning_rate": 1e-3, "lr_scheduler_type": "constant", "max_steps": 3,
            "logging_steps": 1,
            "output_dir": str(out), "report_to": "[]", "backend": "vllm",
            "vllm_server_base_url": base_url, "vllm_server_api_key": API_KEY,
            "max_prompt_length": 64, "save_steps": 1, "vllm_server_timeout": 30}
    sets.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def on_policy_run(model_dir, out, base_url, **extra) -> list[dict]:
    """A 3-step run with vLLM rollouts; checks that the server sampled with the trainer's
    current weights after every sync, and returns the logged metrics."""
    import json as _json

    from grpo_jax.train import train
    train(train_config(model_dir, out, base_url, **extra), devices=jax.devices()[:1])
    hist = [_json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [h["step"] for h in hist] == [1, 2, 3]
    for h in hist:
        assert h["sampling/sampling_logp_difference/mean"] < 1e-4, h
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, h
        assert h["timing/weight_sync"] > 0 and h["weight_sync/bytes_per_s"] > 0
    return hist


LORA = {"use_peft": "true", "lora_r": 4, "lora_alpha": 16, "lora_target_modules": "all-linear",
        "learning_rate": 2e-2}
