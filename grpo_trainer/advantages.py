"""Advantages from rewards: a baseline per group, a scale, and an optional per-reward normalisation.

Estimators (`loss.advantage`), for completion i of a group of G with reward r_i:
- `grpo` (Shao et al. 2024, DeepSeekMath, eq. 3 / sec. 4.1.2): A_i = (r_i - mean(group)) / scale.
- `rloo` (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
  Optimization", sec. 3.2):
  A_i = (r_i - mean of the *other* G-1 rewards) / scale = G/(G-1) (r_i - mean(group)) / scale; the baseline
  does not contain the sample's own reward, so it is unbiased.
- `reinforce_pp` (Hu et al. 2025, "REINFORCE++", arXiv 2501.03262, its group-baseline
  variant for reasoning tasks): the group mean is subtracted,
  then the result is normalised over the whole batch. Its batch mean is 0 by construction (each group's
  centred rewards sum to 0), so this is a division by the batch std of the group-centred rewards.
The scale (`loss.scale_rewards`, for grpo and rloo) is the group's std (`group`, GRPO), the whole
batch's std (`batch`, as TRL), or 1 (`none`, Liu et al. 2025, Dr. GRPO: the std division over-weights
too-easy and too-hard prompts).

Stds are population stds (ddof = 0), so for G = 8 binary rewards with k right
answers the group scale is 1/std = 3.02 (k = 1 or 7), 2.31 (k = 2 or 6), 2.00 (k = 4).
A reward of NaN means "no opinion" (every reward returned None for it): the
sample is left out of its group's statistics and gets advantage 0.

`normalize_then_sum` (`loss.reward_aggregation`) is GDPO's decoupled normalisation (Liu et al. 2026, GDPO,
arXiv 2601.05242): each reward is normalised within its group before the weighted sum, so a reward with a wide range
cannot drown the others and distinct reward combinations keep distinct advantages.
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # keeps near-constant groups finite; exactly constant groups give 0 / eps = 0
ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


def _group_statistics(grouped: torch.Tensor, valid: torch.Tensor):
    """Along dim 1 (the G completions of each group), over valid entries: count, centred values (0 where not
    valid) and population std."""
    count = valid.sum(1, keepdim=True)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = filled.sum(1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(valid, grouped - mean, torch.zeros_like(grouped))
    std = (centered.pow(2).sum(1, keepdim=True) / count.clamp(min=1)).sqrt()  # population std
    return count, centered, std


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", estimator: str = "grpo"
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards: [N] with N = num_groups * group_size, grouped contiguously; NaN = no opinion.

    Returns advantages [N] and statistics: `reward` (mean), `reward_std` (mean of the
    group stds, as TRL logs it) and `frac_reward_zero_std` (share of groups whose
    valid rewards are all equal, which carry no learning signal).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
    grouped = rewards.view(-1, group_size).double()  # [N/G, G]
    valid = ~torch.isnan(grouped)
    count, centered, group_std = _group_statistics(grouped, valid)
    zero_std = (group_std.squeeze(1) == 0) | (count.squeeze(1) < 2)
    if estimator == "rloo":  # r_i - (S - r_i)/(n-1) = n/(n-1) (r_i - S/n)
        centered = centered * count / (count - 1).clamp(min=1)

    if estimator == "reinforce_pp":
        if scale != "batch":
            raise ValueError("reinforce_pp normalises over the batch: scale must be 'batch'")
        spread = centered[valid]
        denom = spread.std(unbiased=False) if spread.numel() > 1 else torch.zeros((), dtype=torch.float64)
    elif scale == "group":
        denom = group_std
    elif scale == "batch":
        flat = rewards[~torch.isnan(rewards)].double()
        denom = flat.std(unbiased=False) if flat.numel() > 1 else torch.zeros((), dtype=torch.float64)
    elif scale == "none":
        denom = None
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
    advantages = centered if denom is None else centered / (denom + STD_EPS)
    advantages[zero_std] = 0.0  # a group with one opinion, or all equal, teaches nothing
    stats = {
        "reward": float(torch.nanmean(rewards.double())) if valid.any() else float("nan"),
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float(zero_std.double().mean()),
    }
    return advantages.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32), stats


def normalize_then_sum(per_function: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """per_function [N, R] (NaN = no opinion), weights [R] -> [N]: sum_k w_k (r_k - mean_g(r_k)) / (std_g(r_k) + eps).

    Each reward is centred and scaled over the completions of its group that it has an opinion on; a reward
    that is constant within a group adds 0 there. NaN where no reward had an opinion (as the plain sum).
    """
    n, r = per_function.shape
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    grouped = per_function.double().view(-1, group_size, r)  # [N/G, G, R]
    valid = ~torch.isnan(grouped)
    _, centered, std = _group_statistics(grouped, valid)
    total = (centered / (std + STD_EPS) * weights.double()).sum(-1).view(-1)  # [N]
    total[~valid.view(n, r).any(1)] = float("nan")
    return total.float()


def batch_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    estimator: str,
    scale: str,
    per_function: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages [N] and reward statistics. With `per_function` (normalize_then_sum), advantages
    come from the per-reward normalised sum, while the statistics still describe the plain weighted sum
    `rewards`: what `reward` means in the logs does not change with the aggregation."""
    advantages, stats = group_advantages(rewards, group_size, scale, estimator)
    if per_function is not None:
        advantages, _ = group_advantages(
            normalize_then_sum(per_function, weights, group_size), group_size, scale, estimator
        )
    return advantages, stats
