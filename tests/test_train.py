"""The training program end to end on a tiny model: it learns, resumes exactly, exports, and
fails cleanly on bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_oracle import tiny_hf_model

from grpo_jax import hf
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.config import load_config
from grpo_jax.train import train

HERE = Path(__file__).parent
REWARD = f"{HERE / 'reward_fixtures.py'}:even_tokens"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer (vocab 49152)."""
    out = tmp_path_factory.mktemp("tiny")
    model = tiny_hf_model("llama", tie=True, vocab=49152, seed=0, hidden_size=64,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out)
    smol = hf.resolve_model_dir(hf.SMOL_ALIAS)
    for f in hf.TOKENIZER_FILES:
        if (smol / f).exists() and f != "generation_config.json":
            shutil.copy(smol / f, out / f)
    prompts = out / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Post number {i}: write something short.\nTL;DR:"})
                    + "\n")
    return out


def config(tiny_dir, out, **extra):
    sets = {
        "name_or_path": str(tiny_dir), "dtype": "float32", "dataset_name":
        str(tiny_dir / "prompts.jsonl"), "reward_funcs": f"[{REWARD}]", "num_generations": 4,
        "max_completion_length": 8, "per_device_train_batch_size": 16,
        "learning_rate": 0.02, "lr_scheduler_type": "constant", "beta": 0.0,
        "output_dir": str(out), "logging_steps": 100, "save_steps": 100, "report_to": "[]",
        "max_steps": 14, "seed": 3, "dp": 1, "temperature": 1.0,
    }
    sets.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def rewards_of(out):
    return [json.loads(line)["reward"] for line in (Path(out) / "metrics.jsonl").open()]


def test_tiny_model_learns_synthetic_reward(tiny_dir, tmp_path):
    os.environ["JAX_PLATFORMS"] = "cpu"
    cfg = config(tiny_dir, tmp_path / "run")
    train(cfg)
    r = rewards_of(tmp_path / "run")
    first, last = np.mean(r[:3]), np.mean(r[-3:])
    assert len(r) == 14
    assert first < 0.65 and last > first + 0.15, (first, last, r)
    # beta = 0: the checkpoint holds params and optimizer state, no reference copy.
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", save_total_limit=None)
    assert ckpt.latest_step() == 14
    assert (tmp_path / "run" / "reward_kl.png").stat().st_size > 1000


def _params_at(out, step, target_cfg, tiny_dir):
    from grpo_jax.train import abstract_state
    ckpt = Checkpointer(Path(out) / "checkpoints", save_total_limit=None)
    state, meta = ckpt.restore(step, abstract_state(target_cfg))
    return jax.tree.map(np.asarray, jax.tree.leaves(state.params)), meta
