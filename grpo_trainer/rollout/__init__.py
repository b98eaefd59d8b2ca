"""Rollout engines: sample G completions for each prompt, and own their lifecycle.

The loop talks to an engine through `RolloutEngine`: `generate`, `sync_weights` (make the sampler use the
trainer's current weights) and `close`. That is all every engine has, so the `hf` engine (the training model
itself, everywhere) and the vLLM engines (a copy of the weights inside vLLM) are interchangeable. What only some
engines do is a capability, a small class of its own that the engine declares as a base, and that callers ask
for by type through `capability(engine, Kind)`, never by the engine's name:
* `SamplesTrainingModel`: it samples from the training model itself (hf), so there are no weights to push: the
  loop skips the push and, under ZeRO-3, the all-gather that would precede it (`needs_weight_sync`).
* `Sleeps`: it frees accelerator memory while the policy is updated (vLLM in the training process).
* `Reconnects`: its sampler is another process that can restart without the pushed weights (vLLM servers):
  `generate` then raises `WeightsLost`, and `reconnect(timeout)` waits for one found gone (`ServerGone`).
* `RunsInLockstep`: its generate calls may be collectives (the hf engine under FSDP: `lockstep_of`).
* `PlansKernels`: it chooses among kernels of this package's before it samples (the hf engine's decode loop:
  rollout/kernel_plan.py), and hands back the plan the run records.
* `TakesEpisodes`: it plays an environment's episodes and wants one EpisodeSpec per prompt (`needs_episodes`).
A wrapper (environments/episodes.py's EpisodeEngine, an agent program's producer) derives from `EngineWrapper`:
`capability` looks through it to the engine it wraps, so a wrapper has exactly the wrapped engine's capabilities
plus its own, without forwarding any by hand. Asking `isinstance(engine, Kind)` instead would miss a wrapped
engine's: callers use `capability`. The faults are this package's (`ServerGone`, `WeightsLost`), so the loop
catches them without importing an engine. What each engine can do is also declared, for the config's checks, by
its entry in `engines.py` (without importing the engine); tests/test_engines.py checks the classes agree.

`registry.build_engine` picks and builds one: each engine reads the sampling
settings common to all (`SamplingSettings`) and its own typed config section;
engines are imported lazily, so nothing from vLLM is imported unless it is
chosen. This module holds only what engines and the loop share, and imports no
engine: the engines import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from ..errors import UserError
from ..seeds import mix_seed  # noqa: F401 (the engines' seed rule, imported from here by them)

if TYPE_CHECKING:
    from ..config import Config
    from ..distributed import Collectives


@dataclass
class Branch:
    """One training sample of a multi-turn episode: a root-to-leaf path of its turns (agents/records.py)."""

    prompt_ids: list[int]  # the root turn's prompt
    completion_ids: list[int]  # everything after it: sampled tokens and what came between turns
    completion_mask: list[int]  # 1 on sampled tokens, 0 on tokens the policy did not sample
    logprobs: list[float]  # the sampler's log-probs on sampled tokens, 0.0 elsewhere
    turns: list[int] = field(default_factory=list)  # the turns on the path, root first
    truncated: bool = False  # its last turn was cut by its length limit (finish reason "length")


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
    # Agents only: per completion, the episode's further samples besides the completion (the branches before its
    # last, when its conversation branched): each becomes a training row of its own with the completion's advantage
    # (samples.TrainingSamples.branch_of). None or [] for a completion that is its episode's only sample.
    branches: list[list[Branch]] | None = None

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
        "branches",
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
    engine that `Reconnects` may see it come back: `reconnect(timeout)` waits for it."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


class PushFailed(UserError, RuntimeError):
    """A weight push that did not complete within its deadline, or after which a sampler does not hold the pushed
    weights (push_checks.py): the run stops in one line, before the step's checkpoint is written."""


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
    """What the loop asks of every engine. What only some can do is a capability (below), asked for by type."""

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
        only for an engine that `TakesEpisodes` and needs them (else None)."""

    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Any = None) -> None:
        """Make the sampler use the trainer's current weights (called only when `needs_weight_sync`, on every rank).

        `version`: what the push is recorded as (the vLLM engines' `weight_version`, the server's
        `/weight_info`; default, the count of pushes); the trainer passes the step whose update made the weights.
        `gather`: weight_sync.zero3_gather's context (None outside ZeRO-3): the weights are gathered one decoder
        layer at a time, every rank taking part, instead of the trainer gathering the whole model first."""

    def close(self) -> None:
        """Release processes and memory; the engine is not used afterwards."""


# ----------------------------------------------------------------------------- capabilities
# Declared by the engine class as a base (nominal: nothing has one by the accident of a method's name), the same
# for every instance; asked for with `capability`, which looks through wrappers. Plain classes, not ABCs, so that
# they can be passed as the `kind` of `capability` (mypy takes no abstract class for a `type[...]` parameter);
# tests/test_engines.py checks that every engine class overrides each method of its capabilities.


class SamplesTrainingModel:
    """It samples from the training model itself: no copy of the weights to push (`sync_weights` is never called),
    and so, under ZeRO-3, no all-gather for a push."""


class Sleeps:
    """It holds accelerator memory that it can free while the policy is updated."""

    def sleep(self) -> None:
        """Free the memory (the loop calls it after sampling, before the update)."""
        raise NotImplementedError

    def wake_up(self) -> None:
        """Undo `sleep`; the engine also wakes itself before it generates or takes weights."""
        raise NotImplementedError


class Reconnects:
    """Its sampler is another process that can restart without the pushed weights: `generate` then raises
    WeightsLost, and a request can find it gone (ServerGone) until it is back."""

    def reconnect(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a sampler that went away; whether it answers again (it has then lost
        the pushed weights)."""
        raise NotImplementedError


class RunsInLockstep:
    """Its generate calls may be collectives (the hf engine under FSDP, where every forward all-gathers): then
    every rank must make the same calls, and `lockstep` is the ranks' collectives (None where they are not)."""

    lockstep: Collectives | None = None


class PlansKernels:
    """It chooses among alternative kernels of this package's, per machine, before it samples anything (the hf
    engine's decode loop: rollout/kernel_plan.py); the plan is what a run records, so a resume samples the same."""

    def settle_kernels(self, recorded: Mapping[str, str] | None = None) -> dict[str, str]:
        """Fix the plan for every shape the engine was built to reach, keeping `recorded` (a resumed run's plan)
        where it can run here, and sample with it from now on; return it, to be recorded. Every rank calls it."""
        raise NotImplementedError


class TakesEpisodes:
    """It plays an environment's episodes (environments/episodes.py)."""

    @property
    def needs_episodes(self) -> bool:
        """Whether `generate` wants `episodes=`, one environments.EpisodeSpec per prompt."""
        raise NotImplementedError


CAPABILITIES: tuple[type, ...] = (SamplesTrainingModel, Sleeps, Reconnects, RunsInLockstep, PlansKernels, TakesEpisodes)

Kind = TypeVar("Kind")


class EngineWrapper:
    """An engine around another one (`inner`) that changes how it samples (the episode loop, an agent program):
    `generate` is the subclass's own (this base has none, so a wrapper that forgets it is no RolloutEngine);
    pushes and closing reach the wrapped engine; and its capabilities are the wrapped engine's, found there by
    `capability`, plus any the wrapper class declares itself. So a new wrapper forwards nothing by hand and drops
    nothing. One that holds more (threads, connections) extends `close`."""

    def __init__(self, inner: RolloutEngine):
        self.inner = inner

    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Any = None) -> None:
        self.inner.sync_weights(model, version=version, gather=gather)

    def close(self) -> None:
        self.inner.close()


def capability(engine: Any, kind: type[Kind]) -> Kind | None:
    """`engine` if it is a `kind`, else the first engine it wraps that is one (`EngineWrapper.inner`, and so on
    down); None where none is."""
    while engine is not None:
        if isinstance(engine, kind):
            return engine
        engine = engine.inner if isinstance(engine, EngineWrapper) else None
    return None


def needs_weight_sync(engine: RolloutEngine) -> bool:
    """Whether the trainer pushes its weights to `engine` after each update: unless it samples the training model."""
    return capability(engine, SamplesTrainingModel) is None


def lockstep_of(engine: RolloutEngine) -> Collectives | None:
    """The ranks' collectives where `engine`'s generate calls are collectives (every rank makes the same calls);
    None elsewhere."""
    found = capability(engine, RunsInLockstep)
    return found.lockstep if found is not None else None


def needs_episodes(engine: RolloutEngine) -> bool:
    """Whether `engine.generate` wants `episodes=` (one EpisodeSpec per prompt)."""
    found = capability(engine, TakesEpisodes)
    return found is not None and found.needs_episodes


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
