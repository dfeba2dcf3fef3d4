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

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Generation settings with TRL GRPOConfig names (the config's `generation` section).
    0/None/1.0 switch a filter off."""

    max_completion_length: int = 512
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    # Tokens that end a completion (kept in it). The trainer adds the tokenizer's EOS.
    stop_token_ids: tuple[int, ...] = ()
    # grpo-jax's own: prompts longer than this are prefilled this many tokens at a time
    # (Decoder.prefill), so a long prompt's activations are one chunk's (0: never).
    prefill_chunk_size: int = 2048
    # The JAX sampler's decode slots (vLLM's name): at most this many rows in flight, each
    # holding a KV cache. None: every row of a round at once, in one batch. Fewer than a
    # round's rows: with continuous_batching a finished row's slot takes the next waiting row
    # (rollout/refill.py); without, the round runs in sub-batches of this many rows, each
    # until its longest row is done.
    max_num_seqs: int | None = None
    continuous_batching: bool = True

    def __post_init__(self):
        object.__setattr__(self, "top_k", int(self.top_k or 0))
        object.__setattr__(self, "min_p", float(self.min_p) if self.min_p else None)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        check(self.max_completion_length >= 1,
              f"max_completion_length={self.max_completion_length} must be >= 1")
        check(self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1] (1.0 = off)")
        check(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 or None = off)")
        check(self.min_p is None or 0 <= self.min_p <= 1,
              f"min_p={self.min_p} must be in [0, 1] (None = off)")
        check(self.prefill_chunk_size >= 0,
              f"prefill_chunk_size={self.prefill_chunk_size} must be >= 0 (0 = never chunk)")
        check(self.repetition_penalty > 0,
              f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 = off)")
        check(self.max_num_seqs is None or self.max_num_seqs >= 1,
              f"max_num_seqs={self.max_num_seqs} must be >= 1 (null: a round's rows at once)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
