"""Rollout generation: the contract (base.py), the native JAX sampler, the vLLM client."""

from grpo_jax.rollout.base import Rollout, RolloutBatch, WeightMode
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams
from grpo_jax.shapes import DEFAULT_BUCKETS

__all__ = ["DEFAULT_BUCKETS", "Rollout", "RolloutBatch", "Sampler", "SamplingParams",
           "WeightMode"]
