"""The train-step tests' tiny decoder (CFG: Qwen2-shaped, tied embeddings, fp32), random GRPO
batches for it and the loss settings they need. Shared by test_train_step and test_lora."""

import jax.numpy as jnp
import numpy as np

from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.models import ModelConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                  tie_word_embeddings=True).replace(dtype=jnp.float32)
P_LEN, C_LEN, N = 6, 10, 16


def make_batch(seed=0, with_old=True, with_ref=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, C_LEN + 1, N)
    c_mask = (np.arange(C_LEN)[None] < lengths[:, None]).astype(np.int32)
    p_start = rng.integers(0, P_LEN - 1, N)
    p_mask = (np.arange(P_LEN)[None] >= p_start[:, None]).astype(np.int32)
    batch = {
        "prompt_ids": rng.integers(0, CFG.vocab_size, (N, P_LEN)).astype(np.int32) * p_mask,
        "prompt_mask": p_mask,
        "completion_ids": rng.integers(0, CFG.vocab_size, (N, C_LEN)).astype(np.int32) * c_mask,
        "completion_mask": c_mask,
        "truncated": lengths == C_LEN,
        "advantages": rng.standard_normal(N).astype(np.float32),
    }
    noise = lambda: (0.05 * rng.standard_normal((N, C_LEN))).astype(np.float32)  # noqa: E731
    base = -3.0 + noise()
    if with_old:
        batch["old_logp"] = base + noise()
    if with_ref:
        batch["ref_logp"] = base + noise()
    return Batch(**batch)


def loss_config(**kw):
    # No sampler log-probs in these batches: TRL's correction (on by default) has nothing to do.
    return LossConfig(vllm_importance_sampling_correction=False, **kw)
