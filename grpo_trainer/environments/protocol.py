"""The protocol between the episode loop and environments: `Episode` (one object playing one episode),
`Environment` (a configured kind, maker of episodes), what passes between them (`EpisodeSpec`, `Reply`,
`EpisodeRecord`), how an episode ends, and the rules every adapter reads values by. The package's `__init__`
re-exports all of it (`grpo_trainer.environments.EpisodeSpec`); the kinds import it from here, so that the
package, which builds the kinds, is not imported back by them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ConfigError

if TYPE_CHECKING:
    from .tools import ToolCall, ToolResult

# Why an episode ended (EpisodeRecord.ended_by). The first four are normal ends; the last three are failures.
ENDED_BY_ENVIRONMENT = "environment"  # the environment said done
ENDED_BY_MODEL = "model"  # the model's turn got no answer (no tool call and no step(): nothing to say)
ENDED_BY_LENGTH = "length"  # rollout.max_completion_length reached (a turn cut, or no room for the answer)
ENDED_BY_TURNS = "turns"  # environment.max_turns model turns were played
FAILED_ERROR = "error"  # the environment raised or broke the protocol
FAILED_TIMEOUT = "timeout"  # a call overran environment.step_timeout, or the episode environment.episode_timeout
FAILED_DISCONNECT = "disconnect"  # a remote environment's connection dropped
ENDINGS = (ENDED_BY_ENVIRONMENT, ENDED_BY_MODEL, ENDED_BY_LENGTH, ENDED_BY_TURNS)
FAILURES = (FAILED_ERROR, FAILED_TIMEOUT, FAILED_DISCONNECT)


class ProtocolBreach(Exception):
    """An environment returned what its convention does not allow (an adapter raises it, naming the class and the
    value): like any exception in its calls, it ends the episode as a failure."""


def reward_number(value: Any) -> float | None:
    """A reward an environment gave, read by the reward functions' rule (`rewards.reward_value`: any real number,
    NumPy scalars, 0-d arrays and bools included) as a float, or None; ValueError when it is not a finite number
    or None. One rule for every real number, wherever it comes from."""
    from ..rewards import reward_value

    number = reward_value(value)
    if number is not None and (not isinstance(number, float) or not math.isfinite(number)):
        raise ValueError(f"not a finite number: {value!r}")
    return number


def check_kwargs(factory: Callable[..., Any], label: str, kwargs: dict[str, Any]) -> None:
    """environment.kwargs against the signature of the class they are given to (missing or unknown arguments): a
    ConfigError in one line, at start (not a traceback, nor every episode failing)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will say
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        given = ", ".join(kwargs) or "none"
        takes = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values())
        raise ConfigError(f"environment.kwargs (given: {given}): {label}({takes}) cannot take them: {exc}") from None


def flag(value: Any) -> bool | None:
    """`done` as a bool (a Python or NumPy bool, or a 0-d bool array), or None when it is not one."""
    if hasattr(value, "ndim") and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()
    return value if isinstance(value, bool) else None


@dataclass(frozen=True)
class EpisodeSpec:
    """What one prompt's episodes start from (the G episodes of a group share it: same row, same seed, so GRPO
    compares G attempts at the same task). Built by the rollout queue and by evaluate."""

    record: dict[str, Any]  # the dataset row
    seed: int  # the group's environment seed, in [0, 2**31)
    episode_id: str  # f"s{step}-d{draw}-p{position}" (eval: f"eval-{index}"); episode j adds f"-g{j}"
    extend_prompt: Callable[[str], list[int]]  # the row's prompt with this text appended, tokenized (the Task's)


@dataclass
class Reply:
    """What an environment says after a model turn."""

    messages: list[dict[str, Any]]  # tool messages (role tool, name, content) or one user message; [] = nothing to say
    done: bool = False
    reward: float | None = None  # a per-step reward (OpenEnv's, summed by the adapter); class environments: None
    invalid_actions: int = 0  # model-side errors told to the model (malformed call, validation error)
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Episode(Protocol):
    """One environment object playing one episode. Every method may block, raise or hang: the loop calls it
    through EnvCalls, and whatever goes wrong ends this episode alone."""

    tools: list[dict[str, Any]]  # the tool schemas shown in the prompt (the same for every episode of a kind)

    def reset(self, spec: EpisodeSpec, j: int) -> str | None:
        """Start episode j of the group `spec`; text appended to the prompt, or None."""

    def respond(self, text: str, calls: list[ToolCall | ToolResult]) -> Reply:
        """Answer a model turn: its decoded text (special tokens skipped) and the tool calls parsed from it (a
        call that could not be parsed is already its error result, environments/tools.py)."""

    def reward(self) -> float | None:
        """The episode's reward, at its end (None: no opinion)."""

    def snapshot(self) -> Any:
        """What reward functions receive for this episode in `environments` (TRL: the object itself)."""

    def close(self) -> None:
        """Release what the episode holds; it is not used afterwards."""


@dataclass
class EpisodeRecord:
    """How one episode went, for rewards (`episodes=`), the failure policy and the metrics. Picklable (rollouts
    cross ranks under dynamic sampling); the environment objects themselves travel separately and never do."""

    ended_by: str  # one of ENDINGS or FAILURES
    env_reward: float | None = None  # Episode.reward() (None: no opinion, or the environment has no reward)
    error: str | None = None  # one line, for failures
    turns: int = 0  # model turns
    invalid_actions: int = 0
    observations_cut: int = 0  # environment messages cut to environment.observation_chars
    env_seconds: float = 0.0  # time in this episode's environment calls
    state: Any = None  # a remote episode's state snapshot (picklable), else None
    group: str = ""  # the group's EpisodeSpec.episode_id: episodes of one group share it (on_error skip_group)

    @property
    def failed(self) -> bool:
        return self.ended_by in FAILURES


@runtime_checkable
class Environment(Protocol):
    """One configured kind of environment: what its episodes share, and a maker of fresh ones."""

    name: str  # for messages, naming the config key: "environment.factory my_env.py:GuessNumber"
    tools: list[dict[str, Any]]  # the tool schemas every episode shows the model
    has_reward: bool  # its episodes' reward() can give a number: the `environment` reward exists
    # Episodes this rank can have alive at once (a remote server's sessions held), or None: no limit (objects in
    # this process; their calls still run at most environment.concurrency at once). The loop plays in waves of it.
    capacity: int | None

    def counters(self) -> dict[str, int]:
        """Events so far, by name, logged per batch as environment/<name> (a remote server's capacity refusals and
        reconnects); {} for kinds that count none."""

    def episode(self) -> Episode:
        """A fresh episode object (called in an EnvCalls thread: constructing it may block or raise)."""

    def close(self) -> None:
        """Release what the kind shares between episodes (a pool of remote sessions); at the end of the run."""
