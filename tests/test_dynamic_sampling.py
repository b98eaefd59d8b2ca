"""The collect phase, called directly: plain and DAPO dynamic sampling, on one rank and on two (threads)."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo_trainer.collect import CollectSettings, Sources, collect
from grpo_trainer.config import load_config
from grpo_trainer.data import PromptSampler
from grpo_trainer.metrics import PhaseTimer
from grpo_trainer.rewards import Reward, RewardBatch
from grpo_trainer.rollout import Rollout, SamplesTrainingModel
from grpo_trainer.rollout_queue import QueueSettings, RolloutQueue
from grpo_trainer.samples import ScoredBatch
from grpo_trainer.geometry import batch_geometry
from helpers import ThreadCollectives, Exchange, run_ranks

G = 4


class FakeEngine(SamplesTrainingModel):  # nothing to push; no server that can restart
    """Completion k of prompt p is [p, k]; the sampler's log-prob of each token is -(p + k / 10)."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def generate(self, prompt_ids, num_generations, seeds=None, episodes=None):
        prompts = [ids[0] for ids in prompt_ids]
        self.calls.append(prompts)
        completions = [[p, k] for p in prompts for k in range(num_generations)]
        logprobs = [[-(p + k / 10)] * 2 for p, k in completions]
        return Rollout(completion_ids=completions, truncated=[False] * len(completions), sampling_logprobs=logprobs)


class FakeTask:
    """Prompt i's completions all score 1, except when i % informative_every == 0: then k % 2 (they differ)."""

    def __init__(self, informative_every: int):
        self.every = informative_every
        self.rewards = [Reward(name="x", fn=lambda **_: None)]

    def prompt_ids(self, indices):
        return [[i] for i in indices]

    def score(self, prompt_rows, rollout):
        completion_ids = rollout.completion_ids
        totals = [float(k % 2) if p % self.every == 0 else 1.0 for p, k in completion_ids]
        total = torch.tensor(totals)
        return RewardBatch(per_function=total[:, None], total=total, metrics={"rewards/x/fast_path": float(len(totals))})


def fake_sources(comm, informative_every: int, dynamic: bool = True, prompts_per_step: int = 8):
    """What collect is given (`collect.Sources`), around the fake engine and task, on the synchronous schedule
    (rollout.max_staleness 0: drawn and sampled when taken); and the engine, to count its calls."""
    cfg = load_config(None, [f"train.prompts_per_step={prompts_per_step}", f"rollout.num_generations={G}",
                             "train.micro_batch_size=4", f"loss.dynamic_sampling={str(dynamic).lower()}",
                             "loss.max_sampling_rounds=3"])
    engine, task, geometry = FakeEngine(), FakeTask(informative_every), batch_geometry(cfg, comm.world, comm.rank)
    queue = RolloutQueue(engine, QueueSettings.of(cfg), geometry=geometry, comm=comm, task=task,
                         sampler=PromptSampler(size=1000, seed=0, shuffle=False), push=lambda step: None)
    return Sources(queue, task, comm, geometry, CollectSettings.of(cfg)), engine


def one_rank(informative_every: int, dynamic: bool = True):
    return fake_sources(ThreadCollectives(Exchange(1), 0), informative_every, dynamic)


def test_fills_the_batch_with_informative_groups_when_most_are_degenerate():
    sources, engine = one_rank(informative_every=3)
    scored = collect(sources, step=1, timer=PhaseTimer())
    # 8 prompts per round, a third of them informative: rounds of 0..7, 8..15, 16..23 give 3 + 2 + 3 = 8.
    assert len(engine.calls) == 3 and scored.sampling_stats["dynamic_sampling/extra_rounds"] == 2
    assert scored.samples.prompt_indices == [0, 3, 6, 9, 12, 15, 18, 21]
    assert scored.samples.completion_ids[:G] == [[0, k] for k in range(G)]  # completions travel with their prompt
    assert scored.samples.rewards.shape == (8 * G,) and scored.samples.rewards.view(8, G).std(1).min() > 0
    assert scored.sampling_stats["dynamic_sampling/generated_groups"] == 24
    assert scored.sampling_stats["dynamic_sampling/filled_degenerate_groups"] == 0
    assert abs(scored.sampling_stats["frac_reward_zero_std"] - 5 / 8) < 1e-9  # of the first round: what the policy does
    assert scored.reward_metrics["rewards/x/fast_path"] == 32  # the first round's counters


def test_stops_at_the_bound_with_a_warning_and_a_full_batch(caplog):
    sources, engine = one_rank(informative_every=100)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        scored = collect(sources, step=1, timer=PhaseTimer())
    assert len(engine.calls) == 4  # the first round + loss.max_sampling_rounds
    assert len(scored.samples.prompt_indices) == 8 and len(scored.samples.completion_ids) == 8 * G
    assert scored.samples.prompt_indices[0] == 0 and scored.sampling_stats["dynamic_sampling/kept_groups"] == 1
    assert scored.sampling_stats["dynamic_sampling/filled_degenerate_groups"] == 7
    assert "dynamic sampling: only 1 of 8 groups had differing rewards after 3 extra rounds" in caplog.text


@pytest.mark.parametrize("dynamic", [False, True])
def test_two_ranks_split_one_batch_and_see_the_same_rewards(dynamic):
    """Both paths, two ranks: each rank trains on its own half of one batch, every rank holds the rewards of the
    whole batch, the sampler's log-probs travel with their completions, and per-reward statistics cover both
    ranks (the dynamic path once reported the main process's own)."""

    def rank_collects(rank, comm) -> ScoredBatch:
        return collect(fake_sources(comm, informative_every=3, dynamic=dynamic)[0], step=1, timer=PhaseTimer())

    first, second = run_ranks(2, rank_collects)
    assert torch.equal(first.samples.rewards, second.samples.rewards)
    both = first.samples.prompt_indices + second.samples.prompt_indices
    assert both == ([0, 3, 6, 9, 12, 15, 18, 21] if dynamic else list(range(8)))
    for scored in (first, second):
        assert len(scored.samples.prompt_indices) == 4
        assert scored.samples.completion_ids == [[p, k] for p in scored.samples.prompt_indices for k in range(G)]
        assert scored.samples.sampler_logprobs == [[-(p + k / 10)] * 2 for p, k in scored.samples.completion_ids]
        # The prompt tokens come from the task (no environment extended them); the loss covers every token.
        assert scored.samples.prompt_ids == [[p] for p in scored.samples.prompt_rows]
        assert not scored.samples.prompts_extended and scored.samples.loss_mask == [[1, 1]] * (4 * G)
        # Round 0 over both ranks: prompts 0..7, of which 0, 3 and 6 average 0.5, the other five 1.
        assert scored.reward_metrics["rewards/x/mean"] == pytest.approx((3 * 0.5 + 5 * 1.0) / 8)
    # The rewards of the whole batch, in rank order: rank 0's completions first.
    local_n = 4 * G
    expected = [float(k % 2) if p % 3 == 0 else 1.0 for p in both for k in range(G)]
    assert first.samples.rewards.tolist() == expected and len(expected) == 2 * local_n
