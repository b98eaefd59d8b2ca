"""Faults that clusters and users produce, produced for real: each ends in one clear line, loses nothing that
was saved, and where the run continues, continues exactly (docs/troubleshooting.md, "Faults")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_trainer.config import RewardConfig
from grpo_trainer.errors import RewardError
from grpo_trainer.rewards import compute_rewards, load_rewards
from helpers import ROOT, run_cli, small_run_overrides

PROMPTS = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]


def slow_rewards(tmp_path, source: str, **config) -> list:
    path = tmp_path / "slow.py"
    path.write_text(source)
    return load_rewards([RewardConfig(name=f"{path}:reward", **config)])


SLEEPS_ON_SAMPLE_1 = (
    "import time\n"
    "def reward(prompts, completions, **kwargs):\n"
    "    if any('2+2' in p for p in prompts):\n"
    "        time.sleep(30)\n"
    "    return [1.0] * len(prompts)\n"
)
ASYNC_SLEEPS_ON_SAMPLE_2 = (
    "import asyncio\n"
    "async def reward(prompts, completions, **kwargs):\n"
    "    if any('3+3' in p for p in prompts):\n"
    "        await asyncio.sleep(30)\n"
    "    return [1.0] * len(prompts)\n"
)


def score(rewards):
    return compute_rewards(rewards, PROMPTS, ["a", "b", "c"], [[1], [2], [3]], {"prompt": PROMPTS})


@pytest.mark.parametrize("source, sample", [(SLEEPS_ON_SAMPLE_1, 1), (ASYNC_SLEEPS_ON_SAMPLE_2, 2)], ids=["sync", "async"])
def test_a_hanging_reward_stops_the_run_naming_the_reward_and_the_sample(tmp_path, source, sample):
    rewards = slow_rewards(tmp_path, source, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RewardError) as err:
        score(rewards)
    assert time.monotonic() - started < 5  # the batch call's timeout, then one more while probing samples
    assert f"reward 'reward' did not return within 0.5 s (rewards.0.timeout) on sample {sample}" in str(err.value)
    assert "rewards.0.on_timeout=none" in str(err.value)


@pytest.mark.parametrize("source", [SLEEPS_ON_SAMPLE_1, ASYNC_SLEEPS_ON_SAMPLE_2], ids=["sync", "async"])
def test_on_timeout_none_scores_the_batch_none_and_counts_it(tmp_path, source):
    rewards = slow_rewards(tmp_path, source, timeout=0.5, on_timeout="none")
    started = time.monotonic()
    batch = score(rewards)
    assert time.monotonic() - started < 3
    assert batch.total.isnan().all()  # no opinion on any sample of that batch
    assert batch.metrics["rewards/reward/timed_out_batches"] == 1.0


def test_a_reward_within_its_timeout_is_unaffected(tmp_path):
    rewards = slow_rewards(tmp_path, "def reward(prompts, **kw):\n    return [0.5] * len(prompts)\n", timeout=5)
    batch = score(rewards)
    assert batch.total.tolist() == [0.5] * 3 and batch.metrics["rewards/reward/timed_out_batches"] == 0.0
