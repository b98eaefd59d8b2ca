"""Reward functions for tests/test_api.py: named in a YAML config as `tests/api_rewards.py:NAME`, and imported
as objects by the same test, so the two runs score with the same code."""

from __future__ import annotations


def accuracy(completions, answer, bonus: float = 0.0, **kwargs):
    """1 (+ bonus) when the completion holds the boxed answer, else 0."""
    return [1.0 + bonus if f"\\boxed{{{a}}}" in c else 0.0 for c, a in zip(completions, answer)]


async def brevity(completions, scale: float, **kwargs):
    """An async reward: shorter is better, None (no opinion) on empty completions."""
    return [-len(c) / scale if c else None for c in completions]
