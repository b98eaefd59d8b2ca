"""Group-relative advantages (Shao et al. 2024, DeepSeekMath, eq. 3 / sec. 4.1.2).

A_i = (r_i - mean(group)) / scale, with scale the group's std (`group`, GRPO),
the whole batch's std (`batch`, as in Hu 2025, REINFORCE++), or 1 (`none`,
Liu et al. 2025, Dr. GRPO: the std division over-weights too-easy and too-hard
prompts).

Stds are population stds (ddof = 0), so for G = 8 binary rewards with k right
answers the scale is 1/std = 3.02 (k = 1 or 7), 2.31 (k = 2 or 6), 2.00 (k = 4).
A reward of NaN means "no opinion" (every reward returned None for it): the
sample is left out of its group's statistics and gets advantage 0.
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # keeps near-constant groups finite; exactly constant groups give 0 / eps = 0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, dict[str, float]]:
    """rewards: [N] with N = num_groups * group_size, grouped contiguously; NaN = no opinion.

    Returns advantages [N] and statistics: `reward` (mean), `reward_std` (mean of the
    group stds, as TRL logs it) and `frac_reward_zero_std` (share of groups whose
    valid rewards are all equal, which carry no learning signal).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).double()  # [N/G, G]
    valid = ~torch.isnan(grouped)
    count = valid.sum(1, keepdim=True)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = filled.sum(1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(valid, grouped - mean, torch.zeros_like(grouped))
    group_std = (centered.pow(2).sum(1, keepdim=True) / count.clamp(min=1)).sqrt()  # population std
    zero_std = (group_std.squeeze(1) == 0) | (count.squeeze(1) < 2)

    if scale == "group":
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
