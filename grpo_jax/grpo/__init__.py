"""GRPO math as pure functions on arrays.

advantages: rewards of a generation batch -> group-relative advantages (host side, numpy).
logprobs:   hidden states -> per-token log-probs and entropies, chunked over the sequence.
loss:       the clipped surrogate, KL and metrics as (numerator, denominator) sums, so that
            gradient accumulation over micro-batches is exact.
train_step: the jitted optimizer step that ties them together.
"""
