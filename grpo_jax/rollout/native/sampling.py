"""Next-token sampling: static settings and pure functions on logits [B, V].

Order of processing, as in transformers' `generate`: repetition penalty, temperature, top-k,
top-p, min-p, then a categorical draw (argmax when temperature == 0).

The reported log-prob of a sampled token is log_softmax(raw_logits / temperature) over the full
vocabulary: no repetition penalty and no top-k/top-p/min-p renormalisation. That is exactly what
the trainer computes for the same token, so importance ratios between trainer and sampler measure
only numerical mismatch (bf16, KV cache), never the filters. (vLLM's `processed_logprobs` would
instead renormalise over the kept set.) At temperature 0 it is log_softmax(raw_logits).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from grpo_jax.config.rollout import SamplingParams  # noqa: F401 (this module's API)


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: float) -> jax.Array:
    """transformers' rule for tokens already in the sequence (`seen` [B, V] bool): positive
    logits are divided by the penalty, negative ones multiplied."""
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def filter_logits(logits: jax.Array, top_k: int = 0, top_p: float = 1.0,
                  min_p: float | None = None) -> jax.Array:
    """Set tokens outside the top-k, nucleus and min-p sets to -inf (logits already tempered).

    Ties with the cut-off value are kept. The most likely token always survives."""
    vocab = logits.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k < vocab or top_p < 1:
        top = jax.lax.top_k(logits, k)[0]  # [B, k], descending
        if top_p < 1:
            probs = jax.nn.softmax(top, axis=-1)
            # Keep a token while the mass strictly above it is < top_p: the smallest prefix whose
            # cumulative probability reaches top_p. The first token has 0 above it.
            above = jnp.cumsum(probs, axis=-1) - probs
            last = jnp.sum(above < top_p, axis=-1, keepdims=True) - 1
            cutoff = jnp.take_along_axis(top, last, axis=-1)
        else:
            cutoff = top[:, -1:]
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    if min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p): no softmax needed.
        cutoff = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return logits


def token_logprob(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """log_softmax(logits / temperature)[tokens] per row (temperature 0 counts as 1)."""
    scaled = logits.astype(jnp.float32) / (temperature or 1.0)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample(keys: jax.Array, logits: jax.Array, params: SamplingParams,
           seen: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. keys [B] (one PRNG key per row, so a row's draw does not depend on
    the batch it sits in), logits [B, V] raw fp32, seen [B, V] bool (needed when
    repetition_penalty != 1). Returns (tokens [B] int32, log-probs [B] fp32, see module doc)."""
    logits = logits.astype(jnp.float32)
    scores = logits
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty != 1 needs `seen` (tokens already present)")
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if params.greedy:
        tokens = jnp.argmax(scores, axis=-1)
    else:
        scores = filter_logits(scores / params.temperature, params.top_k, params.top_p,
                               params.min_p)
        tokens = jax.vmap(jax.random.categorical)(keys, scores)
    tokens = tokens.astype(jnp.int32)
    return tokens, token_logprob(logits, tokens, params.temperature)
