"""Phase 1, collect: sample G completions per prompt and score them -> `ScoredBatch` (samples.py).

Every rank samples its own slice of the step's prompts; the rewards of the whole
batch are gathered, since advantages (and DAPO's filter) need every group. Two
ways to fill the batch, one result type:

- plain: the next `train.prompts_per_step` prompts, once.
- dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2): keep only groups whose
  rewards differ and draw more prompts until the batch holds
  `train.prompts_per_step` of them, at most `loss.max_sampling_rounds` extra
  rounds. Every rank sees the groups of all ranks (gathered as objects), so the
  batch is refilled evenly. Groups beyond the batch are dropped, never carried
  over: data from an older policy would make the next step silently off-policy.
  If the bound is hit, degenerate groups (advantage 0, no gradient) fill the
  batch and a warning says so.

Prompts and completions come from the rollout queue (rollout_queue.py): the step's batch is drawn and sampled
there and then (the synchronous loop, rollout.max_staleness 0), or was sampled while earlier steps trained
(max_staleness K >= 1, no completion more than K weight versions old); dynamic sampling's extra rounds are
sampled when asked for, with the current weights.

The phase is given what it reads (the queue, the task, the collectives, the geometry and its `CollectSettings`),
so tests call it with stand-ins for those. It is the last to see the engine's `Rollout` and the environment's
objects (the rewards get them, through `Task.score`): it ends in the records of samples.py, which are all that
training reads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from .advantages import group_advantages
from .config import Config
from .environments.scoring import environment_metrics, episode_counts, failure_kinds
from .geometry import Geometry
from .metrics import PhaseTimer
from .rewards import RewardBatch, reward_statistics
from .rollout import Rollout
from .rollout_queue import RolloutQueue
from .samples import Ending, EpisodeStats, ScoredBatch, TrainingSamples
from .task import Task

logger = logging.getLogger("grpo_trainer")


@dataclass(frozen=True)
class CollectSettings:
    dynamic_sampling: bool  # loss.dynamic_sampling
    prompts_per_step: int  # train.prompts_per_step: the groups dynamic sampling fills the batch with
    max_sampling_rounds: int  # loss.max_sampling_rounds

    @classmethod
    def of(cls, cfg: Config) -> CollectSettings:
        return cls(cfg.loss.dynamic_sampling, cfg.train.prompts_per_step, cfg.loss.max_sampling_rounds)


@dataclass(frozen=True)
class Sources:
    """Where a step's completions and rewards come from, and what the phase needs to share them over ranks."""

    rollouts: RolloutQueue
    task: Task
    comm: Any  # distributed.Collectives
    geometry: Geometry
    settings: CollectSettings


def collect(sources: Sources, step: int, timer: PhaseTimer) -> ScoredBatch:
    if sources.settings.dynamic_sampling:
        return _collect_dynamic(sources, step, timer)
    indices, rollout, scores = _sample_and_score(sources, step, 0, timer)
    rewards = sources.comm.gather(scores.total)  # [world * local_n]
    # Mean/std of each reward over all ranks; counters and seconds stay the main process's own.
    per_function = sources.comm.gather(scores.per_function)  # [world * local_n, R]
    return ScoredBatch(
        training_samples(sources.task, indices, rollout, rewards, per_function),
        episode_stats(sources.comm, rollout),
        {**scores.metrics, **reward_statistics(sources.task.rewards, per_function)},
    )


def _sample_and_score(
    sources: Sources, step: int, draw: int, timer: PhaseTimer
) -> tuple[list[int], Rollout, RewardBatch]:
    """This rank's prompts of round `draw` (0: the step's batch; more: dynamic sampling), completions, rewards."""
    g, rollouts = sources.geometry.group_size, sources.rollouts
    with timer.phase("timing/rollout"):
        indices, rollout = rollouts.take(step) if draw == 0 else rollouts.sample_more(step, draw)
    if rollout.tool_calls is not None:  # part of the rollout's time, shown on its own
        timer.seconds["timing/tools"] = timer.seconds.get("timing/tools", 0.0) + rollout.tool_seconds
    if rollout.episodes is not None:  # the same for every environment call (tools' included)
        timer.seconds["timing/environment"] = timer.seconds.get("timing/environment", 0.0) + rollout.env_seconds
    with timer.phase("timing/reward"):
        scores = sources.task.score([i for i in indices for _ in range(g)], rollout)
    return indices, rollout, scores


@dataclass
class Group:
    """One prompt's G completions and their rewards, as they travel between ranks under dynamic sampling."""

    prompt_index: int
    rollout: Rollout  # its G completions
    rewards: list[float]  # total per completion (NaN = no opinion)
    per_function: list[list[float]]  # [G, R]

    @property
    def informative(self) -> bool:
        valid = [r for r in self.rewards if not math.isnan(r)]
        return len(valid) >= 2 and max(valid) > min(valid)


def _groups(indices: list[int], rollout: Rollout, scores: RewardBatch, g: int) -> list[Group]:
    totals, per_function = scores.total.tolist(), scores.per_function.tolist()
    return [
        Group(
            p,
            rollout.select(list(range(j * g, (j + 1) * g))),
            totals[j * g : (j + 1) * g],
            per_function[j * g : (j + 1) * g],
        )
        for j, p in enumerate(indices)
    ]


def _collect_dynamic(sources: Sources, step: int, timer: PhaseTimer) -> ScoredBatch:
    target, g, comm = sources.settings.prompts_per_step, sources.geometry.group_size, sources.comm
    kept: list[Group] = []
    degenerate: list[Group] = []
    first_round: list[Group] = []
    generated = 0
    for draw in range(sources.settings.max_sampling_rounds + 1):
        indices, rollout, scores = _sample_and_score(sources, step, draw, timer)
        all_groups: list[Group] = comm.gather_objects(_groups(indices, rollout, scores, g))  # rank order
        if draw == 0:
            first_round, counters = all_groups, scores.metrics
        generated += len(all_groups)
        for grp in all_groups:
            (kept if grp.informative else degenerate).append(grp)
        if len(kept) >= target:
            break
    short = max(0, target - len(kept))
    if short:
        logger.warning(
            "dynamic sampling: only %d of %d groups had differing rewards after %d extra rounds "
            "(loss.max_sampling_rounds); %d degenerate groups fill the batch and add no gradient",
            len(kept),
            target,
            draw,
            short,
        )
    batch = (kept + degenerate[:short])[:target]
    mine = sources.geometry.my_prompts(batch)
    rollout = Rollout.concat([grp.rollout for grp in mine])
    first_rewards = torch.tensor([r for grp in first_round for r in grp.rewards])
    first_per_function = torch.tensor([row for grp in first_round for row in grp.per_function])
    _, first_stats = group_advantages(first_rewards, g, "none")
    sampling_stats = {
        **{k: first_stats[k] for k in ("reward", "reward_std", "frac_reward_zero_std")},
        "dynamic_sampling/extra_rounds": float(draw),
        "dynamic_sampling/generated_groups": float(generated),
        "dynamic_sampling/kept_groups": float(min(len(kept), target)),
        "dynamic_sampling/filled_degenerate_groups": float(short),
    }
    samples = training_samples(
        sources.task,
        [grp.prompt_index for grp in mine],
        rollout,
        torch.tensor([r for grp in batch for r in grp.rewards]),
        torch.tensor([row for grp in batch for row in grp.per_function]),
    )
    return ScoredBatch(
        samples,
        episode_stats(comm, rollout),
        {**counters, **reward_statistics(sources.task.rewards, first_per_function)},
        sampling_stats,
    )


def training_samples(
    task: Task, indices: list[int], rollout: Rollout, rewards: torch.Tensor, per_function: torch.Tensor
) -> TrainingSamples:
    """This rank's completions of prompts `indices` as training reads them, with the rewards of the whole batch.
    The prompt tokens have one source: the environment's extended prompt where it has one, else the task's. An
    episode's further branches (`Rollout.branches`, agents) follow the completions as rows of their own."""
    g = len(rollout.completion_ids) // len(indices) if indices else 0
    prompt_ids = rollout.prompt_ids
    if prompt_ids is None:
        prompt_ids = task.prompt_ids([i for i in indices for _ in range(g)])
    loss_mask = rollout.completion_mask or [[1] * len(c) for c in rollout.completion_ids]
    prompt_ids, completion_ids, loss_mask = list(prompt_ids), list(rollout.completion_ids), list(loss_mask)
    truncated = list(rollout.truncated)
    logprobs = None if rollout.sampling_logprobs is None else list(rollout.sampling_logprobs)
    versions = None if rollout.weight_versions is None else list(rollout.weight_versions)
    branch_of: list[int] = []
    for j, branches in enumerate(rollout.branches or ()):
        for branch in branches:
            prompt_ids.append(list(branch.prompt_ids))
            completion_ids.append(list(branch.completion_ids))
            loss_mask.append(list(branch.completion_mask))
            truncated.append(branch.truncated)
            if logprobs is not None:
                logprobs.append(list(branch.logprobs))
            if versions is not None:
                versions.append(versions[j])
            branch_of.append(j)
    return TrainingSamples(
        prompt_indices=list(indices),
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        loss_mask=loss_mask,
        truncated=truncated,
        sampler_logprobs=logprobs,
        weight_versions=versions,
        rewards=rewards,
        per_function=per_function,
        prompts_extended=rollout.prompt_ids is not None,
        branch_of=branch_of,
    )


def episode_stats(comm, rollout: Rollout) -> EpisodeStats:
    """Where the model used tools or an environment, per completion over all ranks: tool calls, failed calls,
    model turns, and the share that called a tool; with environments, also how the episodes went
    (environments/scoring.py) and this rank's endings and failures. A collective."""
    if rollout.tool_calls is None:
        return EpisodeStats()
    counts = comm.gather(torch.tensor([rollout.tool_calls, rollout.tool_errors, rollout.turns], dtype=torch.float32).T)
    calls, errors, turns = counts.T
    environment: dict[str, float] = {}
    endings, failures = None, []
    if rollout.episodes is not None:
        endings = [Ending(e.ended_by, e.error) for e in rollout.episodes]
        failures = failure_kinds(rollout.episodes)
        environment = environment_metrics(comm.gather(episode_counts(rollout.episodes)))
        names = sorted(rollout.env_counters)  # the same on every rank: one kind of environment
        if names:  # a remote server's capacity refusals and reconnects, summed over ranks
            summed = comm.sum(torch.tensor([float(rollout.env_counters[name]) for name in names]))
            environment.update({f"environment/{name}": float(count) for name, count in zip(names, summed)})
    metrics = {
        **environment,
        "tools/calls_per_completion": float(calls.mean()),
        "tools/errors_per_completion": float(errors.mean()),
        "tools/turns_per_completion": float(turns.mean()),
        "tools/frac_completions_calling": float((calls > 0).float().mean()),
    }
    return EpisodeStats(metrics, endings, failures)
