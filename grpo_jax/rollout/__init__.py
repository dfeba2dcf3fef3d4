"""Rollout generation: the native JAX sampler."""

from grpo_jax.rollout.sampler import DEFAULT_BUCKETS, RolloutBatch, Sampler
from grpo_jax.rollout.sampling import SamplingParams

__all__ = ["DEFAULT_BUCKETS", "RolloutBatch", "Sampler", "SamplingParams"]
