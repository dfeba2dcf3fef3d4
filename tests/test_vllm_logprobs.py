"""Tokens vLLM could not score (log-prob null/NaN, parsed to NaN by grpo_jax.rollout.vllm.client)
must get an importance ratio of exactly 1, as in TRL 1.16 (`nan_to_num(old - sampler, nan=0)`
before the exp; the sampling_logp_difference metrics leave them out).

The ratio needs the trainer's old log-probs, which only grpo/loss.py sees (on-policy they are
stop_gradient(logp) inside the loss), so the rule lives there.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.grpo import loss as loss_lib
from grpo_jax.grpo.batch import Batch

OLD = np.float32([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.7, 0.0, 0.0]])
SAMPLER = np.float32([[-1.1, np.nan, -0.4, 0.0], [np.nan, -0.9, 0.0, 0.0]])
MASK = np.int32([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate",
                                  "sequence_mask"])
def test_nan_sampler_logp_gives_ratio_one(mode):
    cfg = loss_lib.LossConfig(vllm_importance_sampling_mode=mode,
                              vllm_importance_sampling_clip_max=10.0)
    w = np.asarray(loss_lib.sampler_is_weight(jnp.asarray(OLD), jnp.asarray(SAMPLER),
                                              jnp.asarray(MASK, jnp.float32), cfg))
    diff = np.where(np.isnan(SAMPLER), 0.0, (OLD - SAMPLER) * MASK)
    want = np.exp(diff.sum(-1, keepdims=True) if mode.startswith("sequence") else diff)
    np.testing.assert_allclose(w, want, rtol=1e-6)
    if not mode.startswith("sequence"):
        assert w[0, 1] == 1.0 and w[1, 0] == 1.0


def test_nan_sampler_logp_keeps_the_step_finite():
    batch = Batch(np.ones((2, 2), np.int32), np.ones((2, 2), np.int32),
                  np.ones((2, 4), np.int32), MASK, np.zeros(2, bool), np.float32([1.0, -1.0]),
                  old_logp=OLD, sampler_logp=SAMPLER)
    num, sums = loss_lib.grpo_loss_terms(jnp.asarray(OLD), None, batch, loss_lib.LossConfig())
    assert np.isfinite(num)
    for kind in sums.values():
        for name, v in kind.items():
            assert np.isfinite(np.asarray(v)).all(), name
    # the logged difference leaves the unscored tokens out: mean over the 3 scored ones
    total, count = np.asarray(sums["mean"]["sampling/sampling_logp_difference/mean"])
    np.testing.assert_allclose([total, count], [0.1 + 0.1 + 0.2, 3.0], rtol=1e-5)
