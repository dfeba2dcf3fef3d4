"""The grpo_jax decoder's side of the comparisons with transformers (tests/hf_oracle.py has the
other): fixed left-padded batches, the decoder's logits on them, the largest gap at the real
positions, one decode step through the KV cache, and the trainer's log-probs of a rollout."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import positions_from_mask

# 3 left-padded rows of 8 tokens (test_model, test_lora).
TOKENS = np.array([[0, 0, 0, 5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14],
                   [0, 0, 0, 0, 0, 0, 120, 6]])
MASK = (np.arange(8)[None] >= np.array([3, 0, 6])[:, None]).astype(np.int32)
# 3 left-padded rows of 12 tokens, longer than the sliding windows of hf_oracle's tiny models
# (test_families, test_moe): three times the Gemma windows (4), past Mistral's and Phi-3's (5).
LONG_TOKENS = np.array([[0, 0, 0, 5, 17, 99, 3, 42, 8, 77, 12, 64],
                        [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
                        [0, 0, 0, 0, 0, 0, 0, 0, 120, 6, 31, 9]])
LONG_MASK = (np.arange(12)[None] >= np.array([3, 0, 8])[:, None]).astype(np.int32)


def jax_logits(model, tokens=TOKENS, mask=MASK):
    hidden, _ = model(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)),
                      jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


def max_diff_real(a, b, mask=MASK):
    return np.abs(a - b)[mask.astype(bool)].max()


def long_logits(model):
    return jax_logits(model, LONG_TOKENS, LONG_MASK)


def long_diff(a, b):
    return max_diff_real(a, b, LONG_MASK)


@nnx.jit
def decode_step(model, tokens, positions, mask, cache, index):
    return model(tokens, positions, mask, cache=cache, cache_index=index)


def trainer_logp(model, out, temperature):
    """The trainer's own computation on a RolloutBatch `out`: one forward over prompt +
    completion, then log_softmax(logits / T) of each completion token."""
    from grpo_jax.grpo.batch import Batch
    from grpo_jax.grpo.train_step import completion_logps
    batch = Batch(*(jnp.asarray(getattr(out, k)) for k in ("prompt_ids", "prompt_mask",
                                                           "completion_ids", "completion_mask",
                                                           "truncated")),
                  advantages=jnp.zeros(len(out.truncated)))
    return np.asarray(completion_logps(model, batch, temperature, chunk=128)[0])
