"""Group-relative advantages (grpo_trainer.advantages) against hand-derived numbers.

A_i = (r_i - mean(group)) / scale (Shao et al. 2024, DeepSeekMath, sec. 4.1.2), with
population stds (ddof 0). For G = 8 binary rewards with k right answers, p = k/8:
mean = p, std = sqrt(p(1-p)), so a right answer gets (1-p)/std and a wrong one -p/std.
The module adds STD_EPS = 1e-4 to the std, hence relative tolerances of 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_trainer.advantages import group_advantages

NAN = float("nan")


def binary_group(k: int, size: int = 8) -> list[float]:
    return [1.0] * k + [0.0] * (size - k)


# DESIGN.md's worked check: 1/std for k right answers of 8.
#   k=1 or 7: std = sqrt(1/8 * 7/8) = sqrt(7)/8 = 0.33072 -> 1/std = 3.0237
#   k=2 or 6: std = sqrt(2/8 * 6/8) = sqrt(12)/8 = 0.43301 -> 1/std = 2.3094
#   k=4:      std = sqrt(1/2 * 1/2) = 0.5                  -> 1/std = 2.0
@pytest.mark.parametrize(
    "k, inverse_std",
    [(1, 3.02), (7, 3.02), (2, 2.31), (6, 2.31), (4, 2.00)],
)
def test_group_scale_of_binary_rewards_matches_the_worked_check(k, inverse_std):
    advantages, stats = group_advantages(torch.tensor(binary_group(k)), 8, "group")
    right, wrong = advantages[0].item(), advantages[-1].item()
    # A_right - A_wrong = ((1-p) - (-p)) / std = 1/std.
    assert right - wrong == pytest.approx(inverse_std, abs=0.006)
    assert stats["frac_reward_zero_std"] == 0.0


@pytest.mark.parametrize(
    "k, right, wrong",
    [
        (1, math.sqrt(7), -1 / math.sqrt(7)),  # (7/8) / (sqrt7/8) = sqrt7 = 2.6458; -(1/8) / (sqrt7/8) = -0.3780
        (7, 1 / math.sqrt(7), -math.sqrt(7)),  # mirror image of k=1
        (2, math.sqrt(3), -1 / math.sqrt(3)),  # (6/8) / (sqrt12/8) = 6/sqrt12 = sqrt3 = 1.7321; -2/sqrt12 = -0.5774
        (4, 1.0, -1.0),  # +-0.5 / 0.5
    ],
)
def test_group_advantages_of_binary_rewards(k, right, wrong):
    advantages, _ = group_advantages(torch.tensor(binary_group(k)), 8, "group")
    expected = torch.tensor([right] * k + [wrong] * (8 - k))
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=0)
    assert advantages.sum().abs() < 1e-5  # centred within the group


@pytest.mark.parametrize("k", [0, 8])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_right_or_all_wrong_gives_no_update(k, scale):
    # One informative group alongside, so the batch std is not zero.
    rewards = torch.tensor(binary_group(k) + binary_group(4))
    advantages, stats = group_advantages(rewards, 8, scale)
    assert torch.equal(advantages[:8], torch.zeros(8))
    assert advantages[8:].abs().min() > 0.4
    assert stats["frac_reward_zero_std"] == 0.5


def test_batch_scale_divides_by_the_std_of_the_whole_batch():
    # Group 1: k=4 of 8 (mean 0.5); group 2: all wrong. Batch: 4 ones of 16, p = 1/4,
    # batch std = sqrt(1/4 * 3/4) = 0.43301, so group 1 gets +-0.5 / 0.43301 = +-1.1547.
    rewards = torch.tensor(binary_group(4) + binary_group(0))
    advantages, stats = group_advantages(rewards, 8, "batch")
    expected = torch.tensor([1.1547] * 4 + [-1.1547] * 4 + [0.0] * 8)
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=1e-6)
    assert stats["reward"] == pytest.approx(0.25)
    assert stats["reward_std"] == pytest.approx((0.5 + 0.0) / 2)  # mean of the group stds
    assert stats["frac_reward_zero_std"] == 0.5


def test_none_scale_only_centres_rewards():
    # Dr. GRPO (Liu et al. 2025): r - mean, no std. Group [1, 2, 3, 6]: mean 3 -> [-2, -1, 0, 3];
    # group [0, 0, 1, 1]: mean 0.5 -> [-0.5, -0.5, 0.5, 0.5] (the group std would have doubled these).
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    advantages, _ = group_advantages(rewards, 4, "none")
    torch.testing.assert_close(advantages, torch.tensor([-2.0, -1.0, 0.0, 3.0, -0.5, -0.5, 0.5, 0.5]), rtol=1e-3, atol=0)


def test_missing_rewards_are_left_out_of_the_group_statistics_and_get_zero():
    # Group [1, None, 0, 0]: the valid rewards [1, 0, 0] have mean 1/3 and population std
    # sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9) = 0.47140, so A = [(2/3)/0.4714, 0, -(1/3)/0.4714 x2]
    # = [sqrt2, 0, -1/sqrt2, -1/sqrt2]. Counting the missing one as 0 would give [sqrt3, -1/sqrt3 x3].
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0])
    advantages, stats = group_advantages(rewards, 4, "group")
    expected = torch.tensor([math.sqrt(2), 0.0, -1 / math.sqrt(2), -1 / math.sqrt(2)])
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=0)
    assert stats["reward"] == pytest.approx(1 / 3)  # mean of the valid rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_with_fewer_than_two_opinions_teach_nothing(scale):
    rewards = torch.tensor([1.0, NAN, NAN, NAN] + [NAN] * 4 + [1.0, 0.0, NAN, 0.0])
    advantages, stats = group_advantages(rewards, 4, scale)
    assert not torch.isnan(advantages).any()
    assert torch.equal(advantages[:8], torch.zeros(8))
    assert advantages[8] > 0 and advantages[9] < 0 and advantages[10] == 0
    assert stats["frac_reward_zero_std"] == pytest.approx(2 / 3)


def test_batch_scale_ignores_missing_rewards():
    # Valid rewards [1, 0, 1, 0] (mean 1/2, std 1/2); the NaNs must not enter the batch std.
    rewards = torch.tensor([1.0, 0.0, NAN, NAN, 1.0, 0.0, NAN, NAN])
    advantages, _ = group_advantages(rewards, 4, "batch")
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]), rtol=1e-3, atol=0)


def test_frac_reward_zero_std_counts_groups_without_signal():
    rewards = torch.tensor(binary_group(0) + binary_group(8) + binary_group(3) + binary_group(4))
    _, stats = group_advantages(rewards, 8, "group")
    assert stats["frac_reward_zero_std"] == 0.5
    assert stats["reward"] == pytest.approx(15 / 32)


def test_rejects_a_batch_that_does_not_split_into_groups_and_unknown_scales():
    with pytest.raises(ValueError, match="groups of 8"):
        group_advantages(torch.zeros(12), 8)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(8), 8, "sequence")
