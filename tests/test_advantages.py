"""Group advantages vs a per-group re-derivation with Python's statistics module."""

import math
import statistics

import numpy as np
import pytest

from grpo_jax.grpo.advantages import (combine_rewards, compute_advantages, group_advantages,
                                      group_std, normalize_then_sum)


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


def trl_aggregate(per_func, weights, g, aggregation, scale="group", dtype="float32"):
    """TRL 1.16's _generate_and_score_completions, the lines from the unscorable mask to the
    logged reward stats (inline there, so re-typed here), in torch with TRL's own nanstd."""
    torch = pytest.importorskip("torch")
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards_per_func = torch.tensor(per_func, dtype=getattr(torch, dtype))
    w = torch.tensor(weights, dtype=rewards_per_func.dtype)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        if scale in ["group", "none"]:
            std_rewards = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        else:
            std_rewards = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std_rewards + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, g, len(weights))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, len(weights))
        rewards = (reward_k * w.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    logged = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    logged[unscorable_mask] = torch.nan
    stats = {"reward": torch.nanmean(logged).item(), "reward_std": nanstd(logged).item(),
             "frac_reward_zero_std": is_std_zero.float().mean().item()}
    return advantages.numpy(), logged.numpy(), stats


def multi_reward_batch(seed=0, g=4, groups=6):
    """[groups * g, 3] rewards with every NaN case: a function's None in some rows, a row with
    all None (unscorable), a group where one function has a single value (its std is NaN), a
    group where one function is constant (std 0), a fully unscorable group."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((groups * g, 3))
    x[:, 2] = rng.integers(0, 2, groups * g)  # a 0/1 reward
    x[1, 0] = x[6, 1] = x[7, 2] = np.nan      # None here and there
    x[2] = np.nan                              # an unscorable row
    x[8:11, 1] = np.nan                        # group 2: function 1 has one value
    x[12:16, 0] = 0.25                         # group 3: function 0 is constant
    x[16:20] = np.nan                          # group 4: nothing scorable
    return x.astype(np.float32)


@pytest.mark.parametrize("aggregation,scale", [("normalize_then_sum", "group"),
                                               ("normalize_then_sum", "batch"),
                                               ("normalize_then_sum", "none"),
                                               ("sum_then_normalize", "group"),
                                               ("sum_then_normalize", "batch"),
                                               ("sum_then_normalize", "none")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregations_match_trl(aggregation, scale, seed):
    """Advantages and logged stats equal TRL's (float64 run of its lines: to 1e-9; its float32
    run: to float32 rounding). scale_rewards plays no part in normalize_then_sum."""
    x = multi_reward_batch(seed)
    weights = [1.0, 0.5, 2.0]
    rewards, adv, stats = compute_advantages(x, 4, scale, weights, aggregation)
    assert adv.dtype == np.float32 and adv.shape == (24,)
    want64, logged, want_stats = trl_aggregate(x.astype(np.float64), weights, 4, aggregation,
                                               scale, "float64")
    np.testing.assert_allclose(adv, want64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rewards, logged, rtol=1e-6, equal_nan=True)
    for k, v in want_stats.items():
        assert stats[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    want32, _, _ = trl_aggregate(x, weights, 4, aggregation, scale, "float32")
    np.testing.assert_allclose(adv, want32, rtol=1e-4, atol=1e-4)
    assert adv[2] == 0 and (adv[16:20] == 0).all()  # unscorable


def test_normalize_then_sum_by_hand():
    """Two groups of 2, two functions: each function's group z-scores (std + 1e-4), summed with
    the weights, standardised over the batch."""
    x = np.array([[1.0, 10.0], [3.0, 10.0], [0.0, np.nan], [2.0, 4.0]], np.float32)
    adv, stats = normalize_then_sum(x, 2, [1.0, 3.0])
    s2 = 2 ** 0.5  # sample std of two values 2 apart
    z0 = [-1 / (s2 + 1e-4), 1 / (s2 + 1e-4)]  # function 0 in either group
    # Function 1: group 0 constant -> 0; group 1 has one value -> NaN std -> left out.
    summed = np.array([z0[0], z0[1], z0[0], z0[1]])
    want = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    raw = np.array([31.0, 33.0, 0.0, 14.0])
    assert stats["reward"] == pytest.approx(raw.mean())
    assert stats["reward_std"] == pytest.approx(raw.std(ddof=1))
    assert stats["frac_reward_zero_std"] == 0.0
    # All rewards alike in every group: the batch std is 0, every advantage 0, frac 1.
    adv, stats = normalize_then_sum(np.ones((4, 2), np.float32), 2)
    assert (adv == 0).all() and stats["frac_reward_zero_std"] == 1.0


def test_single_function_sum_then_normalize_is_unchanged_and_bad_aggregation():
    x = multi_reward_batch(3)[:, :1]
    rewards, adv, stats = compute_advantages(x, 4, "group")
    want, want_stats = group_advantages(combine_rewards(x), 4, "group")
    np.testing.assert_array_equal(adv, want)
    assert stats == want_stats
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        compute_advantages(x, 4, "group", None, "sum")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        normalize_then_sum(np.zeros((6, 2)), 4)
