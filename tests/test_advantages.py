"""Group advantages vs a per-group re-derivation with Python's statistics module."""

import math
import statistics

import numpy as np
import pytest

from grpo_jax.grpo.advantages import combine_rewards, group_advantages, group_std


def oracle(rewards, g, scale):
    """Plain loops: scorable rewards of a group give its mean and sample std; NaN -> adv 0."""
    valid = [r for r in rewards if not math.isnan(r)]
    batch_std = statistics.stdev(valid) if len(valid) > 1 else math.nan
    adv, stds = [], []
    for start in range(0, len(rewards), g):
        group = [r for r in rewards[start:start + g] if not math.isnan(r)]
        mean = statistics.fmean(group) if group else math.nan
        std = statistics.stdev(group) if len(group) > 1 else math.nan
        if scale == "batch":
            std = batch_std
        for r in rewards[start:start + g]:
            a = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
            adv.append(0.0 if math.isnan(a) else a)
            stds.append(std)
    return np.array(adv), np.array(stds)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_oracle(scale):
    rng = np.random.default_rng(0)
    g = 4
    r = rng.standard_normal(6 * g).astype(np.float32)
    r[4:8] = 0.5  # a group whose completions all score alike
    r[9] = np.nan  # one unscorable completion
    r[12:16] = np.nan  # a fully unscorable group
    r[17:20] = np.nan  # a group with a single scorable completion
    adv, stats = group_advantages(r, g, scale)
    want, want_std = oracle([float(x) for x in r], g, scale)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert adv.dtype == np.float32
    std, zero = group_std(r, g, scale)
    np.testing.assert_allclose(std, want_std, rtol=1e-6)
    assert zero.tolist() == [s == 0 for s in want_std]  # NaN std is not "zero"
    valid = r[~np.isnan(r)].astype(np.float64)
    assert stats["reward"] == pytest.approx(valid.mean(), rel=1e-6)
    assert stats["reward_std"] == pytest.approx(statistics.stdev(valid.tolist()), rel=1e-6)
    assert stats["frac_reward_zero_std"] == pytest.approx(
        (4 / 24) if scale != "batch" else 0.0)
    assert (adv[4:8] == 0).all() and adv[9] == 0 and (adv[12:20] == 0).all()


def test_unscorable_row_gets_zero_advantage_and_is_left_out():
    per_func = np.array([[1.0, np.nan], [np.nan, 2.0], [np.nan, np.nan], [0.0, 0.5],
                         [np.nan, np.nan], [np.nan, np.nan], [3.0, 1.0], [1.0, np.nan]],
                        np.float32)
    rewards = combine_rewards(per_func, [2.0, 1.0])
    np.testing.assert_allclose(rewards[[0, 1, 3, 6, 7]], [2.0, 2.0, 0.5, 7.0, 2.0])
    assert np.isnan(rewards[[2, 4, 5]]).all()
    adv, _ = group_advantages(rewards, 4, "group")
    assert adv[2] == 0 and adv[4] == 0 and adv[5] == 0
    # The group mean and std ignore the unscorable row: (2, 2, 0.5) -> mean 1.5, std sqrt(0.75).
    np.testing.assert_allclose(adv[[0, 1, 3]], np.array([0.5, 0.5, -1.0]) / (0.75 ** 0.5 + 1e-4),
                               rtol=1e-5)
    np.testing.assert_allclose(adv[[6, 7]], [2.5 / (12.5 ** 0.5 + 1e-4), -2.5 / (12.5 ** 0.5 +
                                                                                1e-4)], rtol=1e-5)


def test_combine_rewards_default_weights_and_errors():
    per_func = np.array([[1.0, 2.0], [np.nan, -1.0]])
    np.testing.assert_allclose(combine_rewards(per_func), [3.0, -1.0])
    with pytest.raises(ValueError, match="one weight per function"):
        combine_rewards(per_func, [1.0])
    with pytest.raises(ValueError, match="num_reward_funcs"):
        combine_rewards(np.zeros(3))


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(np.zeros(7), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(np.zeros(8), 4, "std")
