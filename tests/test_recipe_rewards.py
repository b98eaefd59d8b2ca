"""Reward adapters shipped with the recipes."""

from grpo_trainer.config import RewardConfig
from grpo_trainer.rewards import compute_rewards, load_rewards
from helpers import ROOT


def test_gsm8k_reward_scores_against_the_number_after_the_hashes():
    rewards = load_rewards([RewardConfig(name=f"{ROOT}/configs/gsm8k_reward.py:gsm8k_accuracy")])
    gold = ["She has 3 + 4 = 7 apples.\n#### 7", "Total is 1,200 + 34.\n#### 1,234"]
    batch = compute_rewards(rewards, ["q1", "q2"] * 2, ["so \\boxed{7}", "\\boxed{1234}", "\\boxed{8}", "1234 or 7"],
                            [[1]] * 4, {"answer": gold * 2})
    assert batch.total.tolist() == [1.0, 1.0, 0.0, 0.0]
