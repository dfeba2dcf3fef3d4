"""Group-relative advantages from the rewards of one generation batch (host side, numpy).

Follows TRL's GRPOTrainer: completions of a prompt sit in consecutive blocks of num_generations; a
completion whose every reward function returned None is "unscorable": its reward is NaN, it is
left out of the means and stds, and its advantage is 0 (it must not move the policy).

multi_objective_aggregation (TRL's names):
- "sum_then_normalize": the weighted sum of the functions' rewards, then group_advantages
  (scale_rewards: per group, per batch or not at all).
- "normalize_then_sum" (GDPO): each function's rewards normalised within each group, then their
  weighted sum, then that normalised over the whole batch; scale_rewards plays no part.
Either way the logged `reward` / `reward_std` are those of the raw weighted sum.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


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
        std = (np.repeat(_nanstd(r.reshape(-1, num_generations), axis=1), num_generations)
               if num_generations > 1 else np.zeros_like(r))  # TRL: eval may have groups of 1
    else:
        std = np.full_like(r, _nanstd(r)) if r.size > 1 else np.zeros_like(r)
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
    std, is_std_zero = group_std(r, num_generations, scale_rewards)
    adv = r - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    adv = np.nan_to_num(adv, nan=0.0)
    stats = _reward_stats(r)
    stats["frac_reward_zero_std"] = float(is_std_zero.mean())
    return adv.astype(np.float32), stats


def normalize_then_sum(per_func: np.ndarray, num_generations: int,
                       weights: Sequence[float] | None = None):
    """[N, F] rewards -> ([N] float32 advantages, stats), TRL's "normalize_then_sum".

    Per function and group: (r - nanmean) / (nanstd + 1e-4), NaN where the function gave None
    or where the group has fewer than 2 of its values (std undefined); those NaNs drop out of
    the weighted nansum. An unscorable row stays NaN. The sums are then standardised over the
    batch: (s - nanmean) / (nanstd + 1e-4); NaN advantages become 0. frac_reward_zero_std is 1
    when that batch std is 0, else 0; reward and reward_std are of the raw weighted sums.
    """
    raw = combine_rewards(per_func, weights)  # also checks the shapes and the weights
    x = np.asarray(per_func, np.float64)
    n, f = x.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"rewards must have a multiple of num_generations={num_generations} "
                         f"rows (one block per prompt), got {n}")
    w = np.ones(f) if weights is None else np.asarray(weights, np.float64)
    grouped = x.reshape(-1, num_generations, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups
        mean_k = np.nanmean(grouped, axis=1, keepdims=True)
    std_k = (_nanstd(grouped, axis=1)[:, None, :] if num_generations > 1
             else np.zeros_like(mean_k))
    normed = ((grouped - mean_k) / (std_k + 1e-4)).reshape(n, f)
    summed = np.nansum(normed * w, axis=1)
    summed[np.isnan(x).all(axis=1)] = np.nan
    std = _nanstd(summed) if n > 1 else np.float64(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        adv = (summed - np.nanmean(summed)) / (std + 1e-4)
    adv = np.nan_to_num(adv, nan=0.0)
    stats = _reward_stats(raw)
    stats["frac_reward_zero_std"] = float(abs(std) <= 1e-8)  # torch.isclose(std, 0); NaN: no
    return adv.astype(np.float32), stats


def logged_mean_std(values: np.ndarray) -> tuple[float, float]:
    """TRL's logged mean (torch.nanmean) and std (its nanstd, ddof=1) of values, NaN left out:
    NaN where undefined (no value; fewer than 2 for the std), which the log then drops."""
    r = np.asarray(values, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all NaN
        return float(np.nanmean(r)), float(_nanstd(r))


def _reward_stats(rewards: np.ndarray) -> dict:
    """TRL's logged reward and reward_std of the weighted sums (logged_mean_std)."""
    mean, std = logged_mean_std(rewards)
    return {"reward": mean, "reward_std": std}


def compute_advantages(per_func: np.ndarray, num_generations: int, scale_rewards: str = "group",
                       weights: Sequence[float] | None = None,
                       aggregation: str = "sum_then_normalize"):
    """[N, F] rewards -> ([N] weighted-sum rewards (NaN: unscorable), [N] float32 advantages,
    stats) with TRL's multi_objective_aggregation `aggregation`."""
    if aggregation == "sum_then_normalize":
        rewards = combine_rewards(per_func, weights)
        adv, stats = group_advantages(rewards, num_generations, scale_rewards)
    elif aggregation == "normalize_then_sum":
        rewards = combine_rewards(per_func, weights)
        adv, stats = normalize_then_sum(per_func, num_generations, weights)
    else:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got "
                         f"{aggregation!r}")
    return rewards, adv, stats
