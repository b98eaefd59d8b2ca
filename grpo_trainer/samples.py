"""The boundary between producing samples and training on them: what one step's collect phase ends in.

Producing (the rollout queue, the engines, environments and tools, the rewards) works with the engine's
`Rollout`, live environment objects and the task; it ends, in collect.py, in one `ScoredBatch` per step:

- `TrainingSamples`: this rank's completions as training reads them (tokens, loss mask, sampler log-probs,
  truncation, weight versions, prompt indices) and the rewards of the whole batch (all ranks), from which the
  training side computes the advantages;
- `EpisodeStats` beside it: how the episodes went (tool calls, turns, environment counters and failures), for
  the step's record, the unscored-step check and the completions log;
- the step's reward and sampling metrics.

Everything after collect (advantages, batches, the passes, the report) reads these records and nothing of an
engine, an environment or a `Rollout` (tests/test_boundary.py). They hold plain data only, so this module
imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class TrainingSamples:
    """One step's training rows on this rank and the rewards of the whole batch over all ranks, in rank order.

    The first P * G rows are the completions, grouped by prompt (rows i*G .. i*G+G-1 continue prompt
    `prompt_indices[i]`): one per episode, the one its reward judged. Where an episode produced more samples than
    that one (an agent's conversation that branched: agents/records.py), each further sample is a row of its own
    after them, `branch_of` naming its completion: it is trained with that completion's advantage (rewards and
    advantages are per completion), in that completion's group and mini-batch. Without branches (every engine but
    the agents', and most agent episodes) the rows are exactly the completions."""

    prompt_indices: list[int]  # [P] this rank's prompts, as dataset rows
    prompt_ids: list[list[int]]  # [rows] the prompt tokens each row continues
    completion_ids: list[list[int]]  # [rows] each ends with EOS unless truncated
    loss_mask: list[list[int]]  # [rows] per completion token: 1 where the model wrote it, 0 on environment output
    truncated: list[bool]  # [rows] the length limit was reached without EOS
    sampler_logprobs: list[list[float]] | None  # [rows] per token, where the engine reports the sampler's
    weight_versions: list[int] | None  # [rows] the optimizer step whose weights sampled each row
    rewards: torch.Tensor  # [world * P * G] total reward of every completion; NaN: no opinion
    per_function: torch.Tensor  # [world * P * G, R] each reward function's value
    # The environment extended each prompt (its reset text): `prompt_ids` are what the model saw, not the
    # dataset's prompt.
    prompts_extended: bool = False
    # [rows - P * G] the completion (a row < P * G) each row past the completions is a further sample of
    branch_of: list[int] = field(default_factory=list)

    @property
    def completions(self) -> int:
        """This rank's completions (P * G): the rows that are not further branches."""
        return len(self.completion_ids) - len(self.branch_of)

    @property
    def row_completions(self) -> list[int]:
        """The completion each row belongs to: itself for the first P * G rows, `branch_of` for the rest."""
        return [*range(self.completions), *self.branch_of]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """Per-completion values [P * G] (this rank's advantages) as per-row values [rows]."""
        if not self.branch_of:
            return values
        return torch.cat([values, values[torch.tensor(self.branch_of, dtype=torch.long)]])

    @property
    def prompt_rows(self) -> list[int]:
        """The prompt index (dataset row) of each of this rank's completions (the first P * G rows)."""
        g = self.completions // len(self.prompt_indices)
        return [i for i in self.prompt_indices for _ in range(g)]

    def model_tokens(self) -> list[int]:
        """Tokens the model wrote in each row: what the loss is over (environment output excluded)."""
        return [sum(mask) for mask in self.loss_mask]


class Ending(NamedTuple):
    """How one episode ended (one of environments.ENDINGS or FAILURES) and, for a failure, why."""

    ended_by: str
    error: str | None


@dataclass(frozen=True)
class EpisodeStats:
    """How one step's completions came about beyond their tokens, where the model used tools or an environment."""

    metrics: dict[str, float] = field(default_factory=dict)  # tools/... and environment/..., over all ranks
    endings: list[Ending] | None = None  # this rank's, per completion (environments only)
    # This rank's failed episodes by kind: the first error of each kind and how many episodes it ended.
    failures: list[tuple[str, int]] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        """The environment failed every episode of the step, over all ranks."""
        return self.metrics.get("environment/frac_failed") == 1.0


@dataclass(frozen=True)
class ScoredBatch:
    """What the collect phase ends in: the samples to train on, with the statistics and metrics beside them."""

    samples: TrainingSamples
    episodes: EpisodeStats
    reward_metrics: dict[str, float]  # per-reward mean/std over all ranks; the main process's counters, seconds
    # Dynamic sampling only: `reward`, `reward_std`, `frac_reward_zero_std` of the first round (what the policy
    # does, not the filtered batch), and how many rounds and groups it took.
    sampling_stats: dict[str, float] = field(default_factory=dict)
