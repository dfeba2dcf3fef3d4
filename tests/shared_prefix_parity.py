"""Shared-prefix training (Decoder.shared_prefix) against the plain forward: batches of groups
of completions that share their prompt, and the gaps between the two ways (logits, log-probs,
entropies, loss, gradients). Shared by test_shared_prefix (and its float64 subprocess) and
test_context_parallel."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.grpo.batch import Batch
from grpo_jax.grpo.loss import LossConfig
from grpo_jax.grpo.train_step import StepConfig, completion_logps, loss_and_grads
from grpo_jax.models import positions_from_mask

G, GROUPS, P_LEN, C_LEN = 4, 3, 12, 10


def grouped_batch(vocab: int, seed: int = 0, groups: int = GROUPS, prompt: int = P_LEN,
                  completion: int = C_LEN) -> Batch:
    """`groups` left-padded prompts of different lengths, each with G completions of
    different lengths (some truncated), rows of a group consecutive."""
    rng = np.random.default_rng(seed)
    n = groups * G
    p_len = rng.integers(2, prompt + 1, groups)
    p_len[0] = prompt  # one prompt fills the width, the others are left-padded
    p_mask = (np.arange(prompt)[None] >= (prompt - p_len)[:, None]).astype(np.int32)
    p_ids = rng.integers(1, vocab, (groups, prompt)).astype(np.int32) * p_mask
    c_len = rng.integers(1, completion + 1, n)
    c_len[0] = completion
    c_mask = (np.arange(completion)[None] < c_len[:, None]).astype(np.int32)
    return Batch(np.repeat(p_ids, G, 0), np.repeat(p_mask, G, 0),
                 rng.integers(1, vocab, (n, completion)).astype(np.int32) * c_mask, c_mask,
                 c_len == completion, rng.standard_normal(n).astype(np.float32))


def loss_config():
    return LossConfig(vllm_importance_sampling_correction=False, loss_type="dapo", beta=0.0)


def plain_hidden(model, b: Batch):
    ids = jnp.concatenate([b.prompt_ids, b.completion_ids], axis=1)
    mask = jnp.concatenate([b.prompt_mask, b.completion_mask], axis=1)
    return model(ids, positions_from_mask(mask), mask)[0]


def accumulated_grads(model, batch, k, group):
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = StepConfig(loss=loss_config(), temperature=0.9, gradient_accumulation_steps=k,
                     logprob_chunk=4)
    loss, grads, _ = jax.jit(lambda p, b: loss_and_grads(graphdef, cfg, p, b, group=group))(
        params, jax.tree.map(jnp.asarray, batch))
    return float(loss), jax.tree.leaves(jax.tree.map(np.asarray, grads))


def worst_relative(a, b) -> float:
    """max over leaves of max |a - b| / max |a|."""
    return max(float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)) for x, y in zip(a, b))


def parity(model) -> dict:
    """Shared prefixes vs the plain forward on grouped_batch: the largest logit gap (every real
    prompt and completion position) relative to the largest logit, log-prob and entropy gaps,
    (and the log-prob gap in fp32 ulps of the value), and the gradients' worst relative gap: three accumulated micro-batches of one group each
    (shared) vs the whole batch as one micro-batch (plain)."""
    b = jax.tree.map(jnp.asarray, grouped_batch(model.cfg.vocab_size))
    plain = np.asarray(model.logits(plain_hidden(model, b)))
    prompt, comp = model.shared_prefix(b.prompt_ids[::G], b.prompt_mask[::G],
                                       b.completion_ids, b.completion_mask, G)
    shared = np.concatenate([np.repeat(model.logits(prompt), G, 0), model.logits(comp)], 1)
    real = np.concatenate([b.prompt_mask, b.completion_mask], axis=1).astype(bool)
    c_real = np.asarray(b.completion_mask, bool)
    want = completion_logps(model, b, 0.9, 4)
    got = completion_logps(model, b, 0.9, 4, group=G)
    gaps = [float(np.abs(np.asarray(w) - np.asarray(g))[c_real].max()) for w, g in zip(want, got)]
    # The log-prob gap in units in the last place of the fp32 log-softmax both share.
    w = np.asarray(want[0], np.float32)[c_real]
    ulps = float((np.abs(w - np.asarray(got[0], np.float32)[c_real]) / np.spacing(np.abs(w))).max())
    batch = grouped_batch(model.cfg.vocab_size, seed=1)
    loss_plain, g_plain = accumulated_grads(model, batch, 1, 1)
    loss_shared, g_shared = accumulated_grads(model, batch, GROUPS, G)
    return {"logits": float(np.abs(plain - shared)[real].max() / np.abs(plain[real]).max()),
            "logp": gaps[0], "logp_ulps": ulps, "entropy": gaps[1], "loss": abs(loss_plain - loss_shared),
            "grads": worst_relative(g_plain, g_shared)}
