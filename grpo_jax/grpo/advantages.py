"""Group-relative advantages from the rewards of one generation batch (host side, numpy).

Follows TRL's GRPOTrainer with multi_objective_aggregation="sum_then_normalize": completions of a
prompt sit in consecutive blocks of num_generations; a completion whose every reward function
returned None is "unscorable": its reward is NaN, it is left out of its group's mean and std, and
its advantage is 0 (it must not move the policy).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

SCALE_REWARDS = ("group", "batch", "none")


def combine_rewards(per_func: np.ndarray, weights: Sequence[float] | None = None) -> np.ndarray:
    """[N, F] rewards (NaN where a function returned None) -> [N] weighted sums.

    NaN entries are skipped (nansum); a row that is NaN for every function stays NaN so that
    group_advantages can give it advantage 0 instead of treating it as reward 0.
    """
    per_func = np.asarray(per_func, np.float32)
    if per_func.ndim != 2:
        raise ValueError(f"per_func must be [num_completions, num_reward_funcs], got shape "
                         f"{per_func.shape}")
    w = np.ones(per_func.shape[1], np.float32) if weights is None else np.asarray(weights,
                                                                                  np.float32)
    if w.shape != (per_func.shape[1],):
        raise ValueError(f"got {w.size} reward_weights for {per_func.shape[1]} reward functions: "
                         "give one weight per function")
    rewards = np.nansum(per_func * w, axis=1)
    rewards[np.isnan(per_func).all(axis=1)] = np.nan
    return rewards.astype(np.float32)


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """Bessel-corrected std ignoring NaN; NaN where fewer than 2 values are present (as TRL)."""
    count = np.sum(~np.isnan(x), axis=axis)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis) * count / (count - 1)
    return np.where(count > 1, np.sqrt(var), np.nan)


def group_std(rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"):
    """Per-sample std used for scaling: of its group ('group', 'none') or of the whole batch
    ('batch'); and is_std_zero [N] bool (std == 0: every completion of the group scored alike)."""
    r = np.asarray(rewards, np.float64)
    if scale_rewards in ("group", "none"):
        std = np.repeat(_nanstd(r.reshape(-1, num_generations), axis=1), num_generations)
    else:
        std = np.full_like(r, _nanstd(r))
    # torch.isclose(std, 0) with its default atol; a NaN std (< 2 scorable) is not "zero".
    return std, np.abs(std) <= 1e-8


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"):
    """[N] rewards -> ([N] float32 advantages, stats).

    advantage = reward - mean of its group, divided by (std + 1e-4) unless scale_rewards='none'
    (std as in group_std). stats holds what TRL logs per generation batch, as floats:
    reward (mean), reward_std (std over the batch, ddof=1) and frac_reward_zero_std.
    """
    r = np.asarray(rewards, np.float64)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if r.ndim != 1 or num_generations < 1 or r.size % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations="
                         f"{num_generations} entries (one block per prompt), got shape {r.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups: mean NaN, advantage 0
        mean = np.repeat(np.nanmean(r.reshape(-1, num_generations), axis=1), num_generations)
        batch_mean = float(np.nanmean(r)) if np.isfinite(r).any() else 0.0
    std, is_std_zero = group_std(r, num_generations, scale_rewards)
    adv = r - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    adv = np.nan_to_num(adv, nan=0.0)
    batch_std = _nanstd(r)
    stats = {"reward": batch_mean,
             "reward_std": float(batch_std) if np.isfinite(batch_std) else 0.0,
             "frac_reward_zero_std": float(is_std_zero.mean())}
    return adv.astype(np.float32), stats
