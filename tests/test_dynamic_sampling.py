"""DAPO dynamic sampling: refill the batch with groups whose rewards differ, within a bound, and say so."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from grpo_trainer.config import load_config
from grpo_trainer.data import PromptSampler
from grpo_trainer.rewards import RewardBatch
from grpo_trainer.rollout import Rollout
from grpo_trainer.trainer import _dynamic_sampling

G = 4


def fake_world(informative_every: int, prompts_per_step=8):
    """Prompt i yields differing rewards only if i % informative_every == 0; the rest all score 1."""
    cfg = load_config(None, [f"train.prompts_per_step={prompts_per_step}", f"rollout.num_generations={G}",
                             "train.micro_batch_size=4", "loss.dynamic_sampling=true", "loss.max_sampling_rounds=3"])
    sampler = PromptSampler(size=1000, seed=0, shuffle=False)
    calls = []

    def sample_and_score(local_indices):
        calls.append(list(local_indices))
        completions = [[i, k] for i in local_indices for k in range(G)]
        totals = [float(k % 2) if i % informative_every == 0 else 1.0 for i in local_indices for k in range(G)]
        return Rollout(completion_ids=completions, truncated=[False] * len(completions)), RewardBatch(
            per_function=torch.tensor(totals)[:, None], total=torch.tensor(totals), metrics={"rewards/x/mean": 0.5}
        )

    accelerator = SimpleNamespace(process_index=0)
    return cfg, sampler, calls, sample_and_score, accelerator


def test_fills_the_batch_with_informative_groups_when_most_are_degenerate():
    cfg, sampler, calls, sample_and_score, accelerator = fake_world(informative_every=3)
    indices, rollout, rewards, metrics, stats = _dynamic_sampling(
        accelerator, sample_and_score, lambda: sampler.next_indices(8), cfg, local_prompts=8
    )
    # 8 prompts per round, a third of them informative: rounds of 0..7, 8..15, 16..23 give 3 + 2 + 3 = 8.
    assert len(calls) == 3 and stats["dynamic_sampling/extra_rounds"] == 2
    assert indices == [0, 3, 6, 9, 12, 15, 18, 21]
    assert all(i % 3 == 0 for i in indices)
    assert rollout.completion_ids[:G] == [[0, k] for k in range(G)]  # completions travel with their prompt
    assert rewards.shape == (8 * G,) and rewards.view(8, G).std(1).min() > 0
    assert stats["dynamic_sampling/generated_groups"] == 24 and stats["dynamic_sampling/filled_degenerate_groups"] == 0
    assert abs(stats["frac_reward_zero_std"] - 5 / 8) < 1e-9  # of the first round: what the policy does
    assert metrics == {"rewards/x/mean": 0.5}


def test_stops_at_the_bound_with_a_warning_and_a_full_batch(caplog):
    cfg, sampler, calls, sample_and_score, accelerator = fake_world(informative_every=100)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        indices, rollout, rewards, _, stats = _dynamic_sampling(
            accelerator, sample_and_score, lambda: sampler.next_indices(8), cfg, local_prompts=8
        )
    assert len(calls) == 4  # the first round + loss.max_sampling_rounds
    assert len(indices) == 8 and len(rollout.completion_ids) == 8 * G
    assert indices[0] == 0 and stats["dynamic_sampling/kept_groups"] == 1
    assert stats["dynamic_sampling/filled_degenerate_groups"] == 7
    assert "dynamic sampling: only 1 of 8 groups had differing rewards after 3 extra rounds" in caplog.text
