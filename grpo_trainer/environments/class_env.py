"""A class in TRL's environment convention (`environment.factory: my_env.py:GuessNumber`), as episodes.

One object per episode, made by calling the factory (a class, or any zero-argument callable) with
`environment.kwargs`:

- `reset(**row)` starts the episode from the prompt's dataset row (TRL passes the whole row). It may return text,
  appended to the prompt (TRL: to the last user message). Ours also passes `seed` (the group's environment seed)
  when the signature names it or takes `**kwargs`, and `episode_id` when it names it; columns the signature cannot
  take are left out (as OpenEnv's server filters them).
- Every public method defined with `def` (a merely callable class attribute, such as `Helper = dict`, is not one)
  other than the reserved ones (`reset`, `step`, `get_reward`, `reward`, `close`) is a tool the model can call
  (a generator is refused at load); its schema comes from its type hints and `Args:` docstring, as for `environment.tools`
  functions. A method that raises is an error message to the model (TRL: "the recommended way to signal that an
  action is invalid"), not an environment failure. `async def` methods are run to completion.
- `step(reply) -> (feedback, done)`, ours (TRL has no plain-reply hook): answers a turn that calls no tool (games,
  user simulators); the feedback goes back as a user message. Without `step`, such a turn ends the episode, as
  in TRL.
- `get_reward()` (TRL's name; `reward()` is accepted too) scores the episode at its end: a finite number or None.
- `close()`, if defined, is called once the episode is scored.

What the class returns is checked: `reset` not `str | None`, `step` not a `(str, bool)` pair, a reward that is not a
finite number or None, is a breach of the convention and ends the episode as a failure naming the class. Numbers
are read by the reward functions' rule (NumPy scalars and bools are numbers; a NumPy bool is a `done`).
Objects are fresh per episode (TRL reuses them): an episode cannot depend on what an object did before, which
keeps resumed runs exact; a class whose `__init__` is expensive pays it per episode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, UserError
from .calls import EnvCalls
from .protocol import EpisodeSpec, ProtocolBreach, Reply, check_kwargs, flag, reward_number
from .tools import Tool, ToolBox, ToolCall, ToolResult, build_toolbox, tool_message

if TYPE_CHECKING:
    from ..config import Config

UNCUT = 2**62  # ToolBox output limit: none
RESERVED = ("reset", "step", "get_reward", "reward", "close")  # the convention's own methods: never tools


def _awaited(value: Any) -> Any:
    """An `async def` method's result, awaited (we are in a worker thread with no running loop)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _sync(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)  # keeps the signature: ToolBox checks a call's arguments against it
    def run(*args, **kwargs):
        return _awaited(method(*args, **kwargs))

    return run


def method_tools(obj: Any) -> list[Tool]:
    """The object's public methods other than the reserved ones, as tools (schemas from hints and docstrings)."""
    from transformers.utils import get_json_schema

    tools = []
    for name in sorted(dir(type(obj))):
        fn = None if name.startswith("_") or name in RESERVED else _defined_function(type(obj), name)
        if fn is None:
            continue
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ConfigError(
                f"environment.factory: the tool method {type(obj).__name__}.{name} is a generator (it yields); a tool "
                "returns the text the model reads (or a name starting with _ keeps it from the model)"
            )
        method = getattr(obj, name)
        try:
            schema = get_json_schema(method)
        except Exception as exc:
            raise ConfigError(
                f"environment.factory: cannot describe the method {type(obj).__name__}.{name} to the model as a tool "
                f"({exc}); a tool method needs type hints on every argument and a docstring with an Args: section "
                "(or a name starting with _ to keep it from the model)"
            ) from None
        tools.append(Tool(name, schema, _sync(method)))
    return tools


def _defined_function(cls: type, name: str) -> Callable[..., Any] | None:
    """The function behind a method defined with `def` in the class (or a base; static and class methods too), else
    None: a class attribute that is merely callable (`Helper = dict`, a nested class, a callable object) is no
    tool."""
    attr = inspect.getattr_static(cls, name, None)
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    return attr if inspect.isfunction(attr) else None


def _takes(fn: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class ClassEpisode:
    """One object of the class, playing one episode (the `Episode` protocol)."""

    def __init__(self, env: ClassEnvironment, obj: Any):
        self.env = env
        self.obj = obj
        self.tools = env.tools
        # Not cut here: the loop cuts every environment message to environment.observation_chars, and counts it.
        self.box = ToolBox(method_tools(obj) + env.extra_tools, env.tool_timeout, output_chars=UNCUT)
        self.label = type(obj).__name__

    def reset(self, spec: EpisodeSpec, j: int) -> str | None:
        reset = self.obj.reset
        kwargs = {k: v for k, v in spec.record.items() if _takes(reset, k)}
        if _takes(reset, "seed"):
            kwargs["seed"] = spec.seed
        if "episode_id" in inspect.signature(reset).parameters:
            kwargs["episode_id"] = f"{spec.episode_id}-g{j}"
        text = _awaited(reset(**kwargs))
        if text is not None and not isinstance(text, str):
            raise ProtocolBreach(
                f"{self.label}.reset returned {_shown(text)}; expected a str (appended to the prompt) or None"
            )
        return text

    def respond(self, text: str, calls: list[ToolCall | ToolResult]) -> Reply:
        if calls:  # in order, one at a time: the object's state is the model's to change, call by call
            results = [self.box.call(c) if isinstance(c, ToolCall) else c for c in calls]
            return Reply(
                messages=[tool_message(r.name, r.output) for r in results],
                invalid_actions=sum(isinstance(c, ToolResult) for c in calls),
                tool_calls=len(results),
                tool_errors=sum(r.error for r in results),
            )
        step = getattr(self.obj, "step", None)
        if step is None:
            return Reply([])  # TRL: a turn without a tool call ends the episode
        answer = _awaited(step(text))
        done = flag(answer[1]) if isinstance(answer, tuple) and len(answer) == 2 else None
        if done is None or not isinstance(answer[0], str):
            raise ProtocolBreach(f"{self.label}.step returned {_shown(answer)}; expected (feedback: str, done: bool)")
        return Reply([{"role": "user", "content": str(answer[0])}], done=done)

    def reward(self) -> float | None:
        scorer = self.env.scorer
        if scorer is None:
            return None
        value = _awaited(getattr(self.obj, scorer)())
        try:
            return reward_number(value)
        except ValueError:
            raise ProtocolBreach(
                f"{self.label}.{scorer} returned {_shown(value)}; expected a finite number or None"
            ) from None

    def snapshot(self) -> Any:
        return self.obj

    def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if close is not None:
            _awaited(close())


class ClassEnvironment:
    """`environment.factory`: the class, and what its episodes share (the `Environment` protocol)."""

    capacity: int | None = None  # objects in this process: no limit

    def __init__(
        self,
        factory: Callable[..., Any],
        name: str,
        kwargs: dict[str, Any],
        *,
        extra_tools: list[Tool],
        tool_timeout: float,
        step_timeout: float = 30.0,
    ):
        self.factory = factory
        self.name = name
        self.kwargs = dict(kwargs)
        self.extra_tools = extra_tools
        self.tool_timeout = tool_timeout
        label = getattr(factory, "__name__", type(factory).__name__)
        check_kwargs(factory, label, self.kwargs)
        # One object, to read the convention off (TRL does the same). Made and closed under the deadline, as every
        # episode's object is: an __init__ or close() that hangs, raises or calls sys.exit stops the run in one line.
        calls = EnvCalls(1, name, max_abandoned=0)
        sample = self._sample_call(
            calls,
            self._make,
            f"{label}(**environment.kwargs)",
            step_timeout,
            note=" (the first object, made at start to read its methods off)",
        )
        if not callable(getattr(sample, "reset", None)):
            raise ConfigError(
                f"{name}: {type(sample).__name__} has no reset method; an environment class needs reset(**row)"
            )
        methods = method_tools(sample)
        clash = sorted({t.name for t in methods} & {t.name for t in extra_tools})
        if clash:
            raise ConfigError(f"{name}: the method {clash[0]!r} has the name of a tool in environment.tools")
        self.tools = [t.schema for t in methods + extra_tools]
        self.scorer = next((m for m in ("get_reward", "reward") if callable(getattr(sample, m, None))), None)
        self.has_reward = self.scorer is not None
        close = getattr(sample, "close", None)
        if callable(close):
            self._sample_call(calls, lambda: _awaited(close()), f"{type(sample).__name__}.close()", step_timeout)
        calls.close()

    def _sample_call(
        self, calls: EnvCalls, fn: Callable[[], Any], what: str, step_timeout: float, note: str = ""
    ) -> Any:
        outcome = calls.run([(fn, step_timeout)], check=False)[0]
        if outcome.timed_out is not None:  # abandoned in its daemon thread; the object is never used
            raise ConfigError(
                f"{self.name}: {what} did not return within environment.step_timeout ({step_timeout:g} s); stopping"
            )
        if isinstance(outcome.exception, UserError):
            raise outcome.exception
        if outcome.error is not None:
            raise ConfigError(f"{self.name}: {what} raised {outcome.error}{note}")
        return outcome.value

    def _make(self) -> Any:
        return self.factory(**self.kwargs)

    def episode(self) -> ClassEpisode:
        return ClassEpisode(self, self._make())

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def build(cfg: Config) -> ClassEnvironment:
    from ..user_functions import resolve_function

    env = cfg.environment
    assert env.factory is not None, "built for environment.factory only (environments.build_environment)"
    name = f"environment.factory {env.factory}"
    factory = resolve_function(env.factory, "environment.factory", "environment", ConfigError)
    box = build_toolbox(cfg.environment)
    return ClassEnvironment(
        factory,
        name,
        env.kwargs,
        extra_tools=list(box.tools.values()) if box else [],
        tool_timeout=cfg.environment.tool_timeout,
        step_timeout=env.step_timeout,
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
