"""Per-token log-probs and entropies of target tokens, without materialising [B, T, V] logits.

With a 150k vocabulary the full logits of one micro-batch take GBs, and autodiff would keep them
for the backward pass. The sequence is instead cut into chunks that run under lax.map with
jax.checkpoint, so forward and backward each hold one chunk's logits [B, chunk, V] at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models import decoder


def token_logprobs(hidden: jax.Array, head_w: jax.Array, targets: jax.Array, temperature: float,
                   chunk_size: int = 128, softcap: float | None = None,
                   layout=lambda h, w: (h, w), seq_shards: int = 1
                   ) -> tuple[jax.Array, jax.Array]:
    """log softmax(hidden @ head_w / temperature)[target] and the entropy of that distribution.
    `softcap`: the model's final-logit soft-capping (Gemma 2), before the temperature, as
    Decoder.logits applies it. `layout`: lays out each chunk's hidden states [B, chunk, D] and
    the head [D, V] on a mesh (Decoder.head_layout); the chunking's reshape loses the layout,
    and without it each device computed the whole micro-batch's [B, chunk, V] logits and the
    full [D, V] head gradient (Qwen2.5-7B on v5e-16: 2.2 GB of fp32 gradient per chip).
    `seq_shards`: the positions are split over that many devices (the context axis, contiguous
    blocks); each step then takes a chunk of every block, so no device gathers the whole
    sequence's hidden states: memory per step is one chunk's, whatever the length.

    hidden: [B, T, D] (any float dtype), head_w: [D, V], targets: [B, T] int.
    The head is cast to hidden's dtype and the matmul accumulates in fp32, as Decoder.logits
    does, so these match the sampler's log-probs. Returns (logp, entropy), both [B, T] fp32.
    Differentiable w.r.t. hidden and head_w.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"need hidden [B, T, D] and targets [B, T], got {hidden.shape} and "
                         f"{targets.shape}")
    if head_w.ndim != 2 or head_w.shape[0] != hidden.shape[2]:
        raise ValueError(f"head_w must be [D={hidden.shape[2]}, V], got {head_w.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, D = hidden.shape
    s = seq_shards if T % seq_shards == 0 else 1
    per = T // s  # positions per block
    chunk = min(chunk_size, per)
    n = -(-per // chunk)
    pad = n * chunk - per
    hidden, targets = hidden.reshape(B, s, per, D), targets.reshape(B, s, per)
    if pad:  # padded positions compute throwaway values and are cut off below
        hidden = jnp.pad(hidden, ((0, 0), (0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, 0), (0, pad)))
    w = head_w.astype(hidden.dtype)
    hs = hidden.reshape(B, s, n, chunk, D).transpose(2, 0, 1, 3, 4)  # [n, B, s, chunk, D]
    ts = targets.astype(jnp.int32).reshape(B, s, n, chunk).transpose(2, 0, 1, 3)

    @jax.checkpoint  # the backward pass recomputes this chunk's logits instead of storing them
    def one_chunk(xs):
        h, t = xs
        h, t = h.reshape(B, s * chunk, D), t.reshape(B, s * chunk)
        hc, wc = layout(h, w)
        logits = jnp.einsum("bcd,dv->bcv", hc, wc, preferred_element_type=jnp.float32)
        logits = decoder.softcap(logits, softcap) / temperature
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        probs = jnp.exp(logits - lse[..., None])
        entropy = lse - jnp.sum(probs * logits, axis=-1)
        return (picked - lse).reshape(B, s, chunk), entropy.reshape(B, s, chunk)

    logp, entropy = jax.lax.map(one_chunk, (hs, ts))
    unchunk = lambda x: x.transpose(1, 2, 0, 3).reshape(  # noqa: E731
        B, s, n * chunk)[:, :, :per].reshape(B, T)
    return unchunk(logp), unchunk(entropy)
