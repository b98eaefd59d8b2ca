"""How episodes are scored and counted: the environment's own reward, the failure policy, the metrics.

- The environment's reward (`Episode.reward()`, recorded at the end of the episode) is one more `Reward` beside the
  config's functions, named `environment`, weighted by `environment.reward_weight`: it gets per-reward metrics
  (`rewards/environment/mean|std`) and joins the weighted total like any other reward.
- An episode the environment failed (it raised, hung or broke its protocol) is scored by `environment.on_error`,
  after every reward has run (`Task.score`, on the rank that sampled the group, before anything is gathered):
  `zero`: every reward of the episode 0; `none`: no opinion (NaN: left out of its group's statistics,
  advantage 0); `skip_group`: its whole group NaN (fewer than two opinions: advantage 0 for the group; the batch
  keeps its shape). Default `zero`: under `none`, an episode that crashes the environment gets advantage 0 while
  its siblings that failed at the task get a negative one, so crashing the environment would pay.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .protocol import ENDINGS, FAILED_DISCONNECT, FAILED_ERROR, FAILED_TIMEOUT, EpisodeRecord

if TYPE_CHECKING:
    from ..rewards import Reward, RewardBatch

REWARD_NAME = "environment"


def environment_reward(weight: float) -> Reward:
    """The environment's own reward as a reward function over the `episodes` keyword."""
    from ..rewards import Reward

    def environment(completions: list[Any], episodes: list[EpisodeRecord], **_: Any) -> list[float | None]:
        return [e.env_reward for e in episodes]

    return Reward(REWARD_NAME, environment, weight=weight, where="environment")


def named_environment_reward(name: str, weight: float) -> Reward:
    """One of the named rewards an agent's episodes give (environment.reward_weights), `environment/<name>`, read
    from the episode's record (`rewards`; None where the episode gave none)."""
    from ..rewards import Reward

    def named(completions: list[Any], episodes: list[EpisodeRecord], **_: Any) -> list[float | None]:
        return [(getattr(e, "rewards", None) or {}).get(name) for e in episodes]

    return Reward(f"{REWARD_NAME}/{name}", named, weight=weight, where=f"environment.reward_weights.{name}")


def apply_on_error(batch: RewardBatch, episodes: list[EpisodeRecord], policy: str) -> None:
    """Score failed episodes by `policy` (zero | none | skip_group), in place."""
    failed = [j for j, e in enumerate(episodes) if e.failed]
    if not failed:
        return
    if policy == "skip_group":
        groups = {episodes[j].group for j in failed}
        failed = [j for j, e in enumerate(episodes) if e.group in groups]
    value = 0.0 if policy == "zero" else math.nan
    rows = torch.tensor(failed)
    batch.per_function[rows] = value
    batch.total[rows] = value


def failure_kinds(episodes: list[EpisodeRecord]) -> list[tuple[str, int]]:
    """The batch's failures by kind (what failed and how: the call, and the exception's type or the limit), each
    as its first episode's error and how many episodes it ended; in the order they first occur."""
    kinds: dict[tuple[str, ...], list] = {}
    for e in episodes:
        if e.failed:
            error = e.error or e.ended_by
            key = (e.ended_by, *error.split(": ")[:2])
            kinds.setdefault(key, [error, 0])[1] += 1
    return [(error, count) for error, count in kinds.values()]


def failure_summary(name: str, episodes: list[EpisodeRecord]) -> list[str]:
    """One line per kind of failure (failure_kinds), naming the environment: what the log shows, so that an
    environment that fails does not pass for a model that scores 0."""
    n = len(episodes)
    return [f"{name}: {count} of {n} episodes failed: {error}" for error, count in failure_kinds(episodes)]


def episode_counts(episodes: list[EpisodeRecord]) -> torch.Tensor:
    """Per episode [N, 6 + len(ENDINGS)]: turns, errors, timeouts, disconnects, observations cut, invalid actions,
    then one column per normal ending (a failed episode has none)."""
    rows = [
        [
            e.turns,
            e.ended_by == FAILED_ERROR,
            e.ended_by == FAILED_TIMEOUT,
            e.ended_by == FAILED_DISCONNECT,
            e.observations_cut,
            e.invalid_actions,
            *(e.ended_by == end for end in ENDINGS),
        ]
        for e in episodes
    ]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(episodes), 6 + len(ENDINGS))


def environment_metrics(counts: torch.Tensor) -> dict[str, float]:
    """The batch's environment metrics from every rank's `episode_counts`, stacked."""
    if not len(counts):
        return {}
    turns, errors, timeouts, disconnects, cut, invalid = counts[:, :6].T
    metrics = {
        "environment/turns_per_episode": float(turns.mean()),
        "environment/errors": float(errors.sum()),
        "environment/timeouts": float(timeouts.sum()),
        "environment/disconnects": float(disconnects.sum()),
        "environment/frac_failed": float((errors + timeouts + disconnects).mean()),
        "environment/observations_cut": float(cut.sum()),
        "environment/invalid_actions_per_episode": float(invalid.mean()),
    }
    for k, end in enumerate(ENDINGS):
        metrics[f"environment/frac_ended_by_{end}"] = float(counts[:, 6 + k].mean())
    return metrics
