"""Rollout engines: sample G completions for each prompt, and own their lifecycle.

The loop talks to an engine through `RolloutEngine` alone, so the `hf` engine
(the training model itself, everywhere) and the vLLM engines (a copy of the
weights inside vLLM) are interchangeable. An engine says whether it needs the
trainer's weights pushed after each update (`needs_weight_sync`: the `hf` engine
samples from the training model, so the loop skips the push and, under ZeRO-3,
the all-gather that would precede it), frees its memory while the policy is
updated (`sleep`, `wake_up`) and releases what it holds at the end (`close`).
Callers ask the engine what it can do, never its name: whether it samples outside the training
process (`samples_outside_process`: sampling can overlap the update, rollout.max_staleness >= 1), whether its
sampler can restart without the pushed weights (`can_lose_weights`; `reconnect(timeout)` waits for it to come
back), whether its generate calls are collectives (`lockstep`). Its faults are this package's (`ServerGone`,
`WeightsLost`), so the loop catches them without importing an engine. The same capabilities are declared, for
the config's checks, by the engine's entry in `engines.py` (without importing the engine); a test checks
that every engine class and the tools wrapper have every member of the protocol and agree with their entry.

`registry.build_engine` picks and builds one: each engine reads the sampling
settings common to all (`SamplingSettings`) and its own typed config section;
engines are imported lazily, so nothing from vLLM is imported unless it is
chosen. This module holds only what engines and the loop share, and imports no
engine: the engines import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from ..errors import UserError
from ..seeds import mix_seed  # noqa: F401 (the engines' seed rule, imported from here by them)

if TYPE_CHECKING:
    from ..config import Config


@dataclass
class Rollout:
    """Completions for a list of prompts, grouped: rows i*G .. i*G+G-1 belong to prompt i. What engines and
    environments produce and rewards read; collect turns it into the step's `samples.TrainingSamples` and
    `EpisodeStats`, and nothing after collect reads it."""

    completion_ids: list[list[int]]  # each ends with EOS unless truncated
    truncated: list[bool]  # True when max_completion_length was reached without EOS
    # Per-token log-probs under the sampler, when the engine reports them (for the
    # sampler/trainer mismatch metric and truncated importance sampling); same lengths as completion_ids.
    sampling_logprobs: list[list[float]] | None = None
    # Multi-turn rollouts (environment.tools, environments/episodes.py) only; None otherwise.
    completion_mask: list[list[int]] | None = None  # 1 on tokens the model wrote, 0 on tool output: no loss there
    conversations: list[list[dict[str, Any]]] | None = None  # each completion as messages, for the rewards
    tool_calls: list[int] | None = None  # tool calls per completion
    tool_errors: list[int] | None = None  # of which failed (malformed, unknown tool, error, timeout)
    turns: list[int] | None = None  # model turns per completion
    tool_seconds: float = 0.0  # wall time spent running tools on this rank
    # The weight version that sampled each completion (the optimizer step whose weights the sampler held; 0: the
    # initial weights). Set by the loop's rollout queue (rollout_queue.py), which knows what it pushed.
    weight_versions: list[int] | None = None
    # Environments (`environment:`, grpo_trainer/environments) only; None otherwise.
    prompt_ids: list[list[int]] | None = None  # each completion's prompt, when a reset text extended the row's
    episodes: list[Any] | None = None  # environments.EpisodeRecord per completion: how its episode went (picklable)
    # What reward functions get as `environments` (TRL: the objects). Never pickled: objects stay on their rank.
    environments: list[Any] | None = None
    env_seconds: float = 0.0  # wall time spent in environment calls on this rank
    # Events of this rank's environment while it sampled these completions, by name (a remote server's
    # capacity_refusals and reconnects; {} for environments that count none): logged as environment/<name>.
    env_counters: dict[str, int] = field(default_factory=dict)

    PER_COMPLETION: ClassVar[tuple[str, ...]] = (
        "completion_ids",
        "truncated",
        "sampling_logprobs",
        "completion_mask",
        "conversations",
        "tool_calls",
        "tool_errors",
        "turns",
        "weight_versions",
        "prompt_ids",
        "episodes",
    )

    def select(self, rows: list[int]) -> Rollout:
        """The given completions, every per-completion field alike (tool and environment seconds are not split)."""
        picked: dict[str, Any] = {
            name: None if getattr(self, name) is None else [getattr(self, name)[j] for j in rows]
            for name in self.PER_COMPLETION
        }
        environments = None if self.environments is None else [self.environments[j] for j in rows]
        return Rollout(**picked, environments=environments)

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        joined: dict[str, Any] = {
            name: None if getattr(parts[0], name) is None else [x for p in parts for x in getattr(p, name)]
            for name in cls.PER_COMPLETION
        }
        environments = None
        if all(p.environments is not None for p in parts):
            environments = [x for p in parts for x in p.environments or ()]
        counters: dict[str, int] = {}
        for part in parts:
            for name, count in part.env_counters.items():
                counters[name] = counters.get(name, 0) + count
        return cls(
            **joined,
            environments=environments,
            tool_seconds=sum(p.tool_seconds for p in parts),
            env_seconds=sum(p.env_seconds for p in parts),
            env_counters=counters,
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without `environments`: environment objects never cross ranks (dynamic sampling gathers rollouts)."""
        return {**self.__dict__, "environments": None}


@dataclass(frozen=True)
class SamplingSettings:
    """What every engine samples with: the `rollout` section's common keys and the tokenizer's stop tokens."""

    eos_token_ids: list[int]
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    stop: tuple[str, ...] = ()  # stop strings (stop.py): a completion ends on the token that completes one
    batch_size: int = 0  # prompts per generate call (0: all at once)


class ServerUnreachable(UserError, ConnectionError):
    """A sampler in another process (a vLLM server) does not answer (in time, or at all)."""


class ServerGone(ServerUnreachable):
    """The connection was refused or dropped: the sampler's process went away (as opposed to a slow answer). An
    engine that `can_lose_weights` may see it come back: `reconnect(timeout)` waits for it."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


class WeightsLost(RuntimeError):
    """Samplers came back after going away (or restarted) and no longer hold the pushed weights.

    Push the current weights (`engine.sync_weights(model, version)`) and sample again. `message` replaces the
    default one (the rollout queue's generations skipped after an earlier one failed)."""

    def __init__(self, urls: list[str], version: Any, message: str | None = None):
        self.urls = list(urls)
        self.version = version
        super().__init__(
            message
            or (
                f"vLLM server(s) {', '.join(self.urls)} restarted and lost the pushed weights (version {version}): "
                "push the current weights before sampling again"
            )
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop asks of an engine. The capabilities (the attributes) are the engine class's own, the same
    for every instance, and match its entry in engines.py; a wrapper forwards every one (environments/episodes.py)."""

    # Read-only properties here, so that a class attribute and a wrapper's forwarding property both satisfy them.
    @property
    def needs_weight_sync(self) -> bool:
        """False when the engine samples from the training model itself: no push, and no ZeRO-3 gather for one."""

    @property
    def samples_outside_process(self) -> bool:
        """Sampling runs in another process (a server), so it can overlap the update (rollout.max_staleness >= 1)."""

    @property
    def can_lose_weights(self) -> bool:
        """The sampler is a process that can restart without the pushed weights: `generate` then raises
        WeightsLost, and a request can find it gone (ServerGone) until it is back (`reconnect`)."""

    @property
    def needs_episodes(self) -> bool:
        """`generate` runs an environment's episodes and takes `episodes`, one environments.EpisodeSpec per prompt
        (the EpisodeEngine wrapper); the samplers themselves take none."""

    @property
    def lockstep(self) -> Any:
        """The ranks' collectives where every generate call is itself a collective (the hf engine under FSDP): then
        every rank makes the same calls (environments/episodes.py runs a round while any rank has a conversation going).
        None elsewhere."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[Any] | None = None,
    ) -> Rollout:
        """G completions per prompt. With `seeds`, prompt i's group is drawn from seeds[i] alone, so the
        result does not depend on batching or on how prompts are split over ranks. `max_tokens` lowers the
        length limit for this call (multi-turn rollouts continue conversations within what is left). `episodes`:
        only where `needs_episodes` (else None)."""

    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Any = None) -> None:
        """Make the sampler use the trainer's current weights (called only when needs_weight_sync, on every rank).

        `version`: what the push is recorded as (the vLLM engines' `weight_version`, the server's
        `/weight_info`; default, the count of pushes); the trainer passes the step whose update made the weights.
        `gather`: weight_sync.zero3_gather's context (None outside ZeRO-3): the weights are gathered one decoder
        layer at a time, every rank taking part, instead of the trainer gathering the whole model first."""

    def plan_kernels(
        self, max_rows: int, max_context: int, recorded: Mapping[str, str] | None = None, decide: bool = True
    ) -> dict[str, str]:
        """Choose, before anything is sampled, the engine's alternative kernels for every shape a run reaches
        (rollout/kernels.py): at most `max_rows` rows per decode step, `max_context` positions; `recorded` (a
        resumed run's plan) is kept where it can run. {} for engines with nothing to choose (vLLM's own)."""

    def use_kernels(self, plan: Mapping[str, str]) -> None:
        """Sample with `plan` (what plan_kernels returned, on this or the main process) from now on."""

    def reconnect(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a sampler that went away (ServerGone); whether it answers again (it has
        then lost the pushed weights). False at once for engines that cannot lose their weights."""

    def sleep(self) -> None:
        """Free the engine's accelerator memory while the policy is updated (a no-op where nothing can be freed)."""

    def wake_up(self) -> None:
        """Undo `sleep`; engines also wake themselves before generating or taking weights."""

    def close(self) -> None:
        """Release processes and memory; the engine is not used afterwards."""


class Sampler:
    """For the engines that sample (every one but the EpisodeEngine wrapper): no environment of their own."""

    needs_episodes = False


class InProcess(Sampler):
    """For engines that sample inside the training process: nothing to overlap, nothing that restarts."""

    samples_outside_process = False
    can_lose_weights = False

    def reconnect(self, timeout: float) -> bool:
        return False


class VendorKernels:
    """For engines that sample with another library's kernels (vLLM): no alternatives of ours to plan."""

    def plan_kernels(
        self, max_rows: int, max_context: int, recorded: Mapping[str, str] | None = None, decide: bool = True
    ) -> dict[str, str]:
        return {}

    def use_kernels(self, plan: Mapping[str, str]) -> None:
        pass


def sampling_settings(cfg: Config, eos_token_ids: list[int]) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(
        eos_token_ids=list(eos_token_ids),
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        stop=tuple(r.stop),
        batch_size=r.batch_size,
    )
