"""An OpenEnv environment in this process (`environment.openenv: my_env.py:GuessEnv`), as episodes; and how an
OpenEnv Action and Observation become what the model writes and reads, shared with the remote kind (openenv_ws.py).

OpenEnv (PyPI `openenv`, 0.10) environments are classes with `reset(seed, episode_id, **kw) -> Observation` and
`step(action) -> Observation`, whose Action and Observation are pydantic models. Nothing here imports openenv: the
class is used by its methods (duck-typed), so the package does not depend on it, and openenv 0.10 cannot be
installed beside vLLM 0.32 anyway (their mcp pins conflict; docs/environments.md).

- The model acts through one tool, named `environment.action_tool` (default: the Action class name without
  `Action`, in snake_case: `GuessAction` -> `guess`), whose parameters are the Action's JSON schema (its
  `metadata` field left out). A plain reply is an action too: a JSON object in the text, or, for an Action with
  exactly one required string field (chat, echo and user-simulator environments), the whole reply as that field.
- A reply that is not an action, or an action the Action class rejects (pydantic's validation), is told to the
  model as an error message and counted (`invalid_actions`): it is the model's mistake, not the environment's.
- An observation is shown as its text field (`environment.observation_field`, else its only string field, else the
  whole observation as compact JSON, `done`, `reward` and `metadata` left out): as a tool message when the action
  came from a tool call, as a user message otherwise. The reset observation is appended to the prompt (TRL's
  place for reset text); a reset that says `done` lets the model take its first turn and nothing more.
- The episode's reward is the sum of its steps' rewards (None when every step's is None). `step` is called
  without `timeout_s`, as OpenEnv's own server does: the loop's time limits (environment.step_timeout) apply.
- A step that raises, or an observation whose `done` is not a bool or whose reward is not a finite number, ends
  the episode as a failure. A fresh object per episode (constructed in the loop's worker threads); `snapshot()` is
  the object itself, so reward functions can read its `state`.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..errors import ConfigError
from .protocol import EpisodeSpec, ProtocolBreach, Reply, check_kwargs, flag, reward_number
from .tools import ToolCall, ToolResult, tool_message

if TYPE_CHECKING:
    from ..config import Config

RESERVED_FIELDS = ("done", "reward", "metadata")  # an Observation's own fields: never shown as its text


def default_tool_name(action_title: str) -> str:
    """`GuessAction` -> `guess`, `MoveTileAction` -> `move_tile`; a class named just `Action` -> `action`."""
    stem = (
        action_title[: -len("Action")] if action_title.endswith("Action") and action_title != "Action" else action_title
    )
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


def _is_string(prop: dict[str, Any]) -> bool:
    """A JSON-schema property that holds text (`str`, or `str | None`)."""
    if prop.get("type") == "string":
        return True
    options = prop.get("anyOf", [])
    return any(o.get("type") == "string" for o in options) and all(o.get("type") in ("string", "null") for o in options)


def format_validation_errors(errors: list[dict[str, Any]]) -> str:
    """pydantic's error list (in process, or a server's VALIDATION_ERROR) as one line for the model."""
    parts = []
    for e in errors:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "action"
        parts.append(f"{where}: {e.get('msg', e.get('type', 'invalid'))}")
    return "error: invalid action: " + "; ".join(parts)


@dataclass(frozen=True)
class Decoded:
    """A model turn read as an action: its fields, or the error message to answer it with."""

    payload: dict[str, Any] | None
    error: str | None
    tool: str | None  # the tool call's name when the action came from one (the answer is then a tool message)
    calls: int  # tool calls in the turn
    call_errors: int  # of which could not be used


class ActionCodec:
    """An Action schema as the model sees it (one tool) and writes it (the tool call, or a plain reply)."""

    def __init__(self, schema: dict[str, Any], tool_name: str | None):
        properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        required = [k for k in schema.get("required", []) if k != "metadata"]
        self.title = schema.get("title", "Action")
        self.name = tool_name or default_tool_name(self.title)
        self.fields = set(properties)
        parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
        if "$defs" in schema:
            parameters["$defs"] = schema["$defs"]
        description = schema.get("description") or f"Act in the environment: a {self.title}."
        self.tool = {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": parameters},
        }
        # A single required text field takes a whole plain reply (chat and user-simulator environments).
        self.text_field = required[0] if len(required) == 1 and _is_string(properties[required[0]]) else None

    def decode(self, text: str, calls: list[ToolCall | ToolResult]) -> Decoded:
        """The action in a model turn. One action per turn: a tool call of this codec's tool, or a plain reply."""
        if calls:
            call = calls[0]
            if len(calls) > 1:
                error = f"error: one action per turn; this turn made {len(calls)} tool calls"
                return Decoded(None, error, self.name, len(calls), len(calls))
            if isinstance(call, ToolResult):  # could not be parsed: already its error message
                return Decoded(None, call.output, call.name, 1, 1)
            if call.name != self.name:
                return Decoded(None, f"error: unknown tool {call.name!r}; the tool is {self.name!r}", call.name, 1, 1)
            return Decoded(dict(call.arguments), None, self.name, 1, 0)
        obj = _json_object(text)
        if obj is not None and (self.text_field is None or set(obj) <= self.fields):
            return Decoded(obj, None, None, 0, 0)
        if self.text_field is not None:
            return Decoded({self.text_field: text}, None, None, 0, 0)
        error = f"error: no action: call the tool {self.name!r}, or reply with a JSON object of its arguments"
        return Decoded(None, error, None, 0, 0)

    def answer(self, content: str, decoded: Decoded) -> dict[str, Any]:
        """The message that answers a turn: a tool message after a tool call, a user message after a plain reply."""
        if decoded.tool is not None:
            return tool_message(decoded.tool, content)
        return {"role": "user", "content": content}

    def invalid(self, decoded: Decoded, error: str) -> Reply:
        """The answer to a turn that is not a valid action: the error, told to the model."""
        return Reply(
            [self.answer(error, decoded)],
            invalid_actions=1,
            tool_calls=decoded.calls,
            tool_errors=max(decoded.call_errors, 1 if decoded.tool is not None else 0),
        )


def _json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a reply consists of, or holds between its first `{` and last `}`; None if none."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        obj = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


@dataclass(frozen=True)
class Observed:
    """One observation, checked: its fields (done, reward, metadata left out), whether it ends the episode, its
    reward."""

    fields: dict[str, Any]
    done: bool
    reward: float | None


def check_observation(fields: dict[str, Any], done: Any, reward: Any, where: str) -> Observed:
    """An observation's parts, or ProtocolBreach naming `where` when `done` is not a bool or the reward not a
    finite number or None (an environment that says `done="yes"` is broken, not done)."""
    ended = flag(done)
    if ended is None:
        raise ProtocolBreach(f"{where} returned an observation whose done is {done!r}; expected true or false")
    try:
        number = reward_number(reward)
    except ValueError:
        raise ProtocolBreach(
            f"{where} returned an observation whose reward is {reward!r}; expected a finite number or null"
        ) from None
    return Observed({k: v for k, v in fields.items() if k not in RESERVED_FIELDS}, ended, number)


class ObservationText:
    """How an observation becomes the text the model reads: `environment.observation_field`, else the only
    string field of its schema, else the whole observation as compact JSON."""

    def __init__(self, field: str | None):
        self.field = field
        self._chosen: dict[int, str | None] = {}  # per schema (id of its dict): the text field, None for JSON

    def text_field(self, schema: dict[str, Any]) -> str | None:
        if self.field is not None:
            return self.field
        key = id(schema)
        if key not in self._chosen:
            props = schema.get("properties", {})
            strings = [k for k, v in props.items() if k not in RESERVED_FIELDS and _is_string(v)]
            self._chosen[key] = strings[0] if len(strings) == 1 else None
        return self._chosen[key]

    def render(self, observed: Observed, schema: dict[str, Any], where: str) -> str:
        field = self.text_field(schema)
        if field is None:
            return json.dumps(observed.fields, ensure_ascii=False, separators=(",", ":"), default=str)
        if field not in observed.fields:
            raise ProtocolBreach(
                f"{where} returned an observation without the field {field!r} (environment.observation_field)"
            )
        value = observed.fields[field]
        return "" if value is None else str(value)


class RewardSum:
    """An episode's reward: the sum of its steps' rewards, None while every one was None."""

    def __init__(self):
        self.total: float | None = None

    def add(self, reward: float | None) -> None:
        if reward is not None:
            self.total = reward if self.total is None else self.total + reward


def reset_kwargs(reset: Callable[..., Any], spec: EpisodeSpec, j: int) -> dict[str, Any]:
    """What `reset` is called with: the row's columns its signature takes (all of them with `**kwargs`, as
    OpenEnv's server filters them), the group's seed and the episode's id."""
    params = inspect.signature(reset).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in spec.record.items() if takes_all or k in params}
    kwargs.update(seed=spec.seed, episode_id=f"{spec.episode_id}-g{j}")
    return {k: v for k, v in kwargs.items() if takes_all or k in params}


class OpenEnvTurns:
    """What both OpenEnv kinds do with a model turn: read it as an action (or answer the model's mistake), step,
    show the observation, add up the rewards. A subclass says how to step (`_step`) and sets `done` at reset."""

    def __init__(self, env: Any):
        self.env = env  # has .codec, .tools
        self.tools = env.tools
        self.done = False
        self.rewards = RewardSum()

    def respond(self, text: str, calls: list[ToolCall | ToolResult]) -> Reply:
        if self.done:  # the reset said done: the model's first turn was its only one
            return Reply([], done=True)
        codec = self.env.codec
        decoded = codec.decode(text, calls)
        if decoded.error is not None:
            return codec.invalid(decoded, decoded.error)
        stepped = self._step(decoded.payload)
        if isinstance(stepped, str):  # the Action rejected it
            return codec.invalid(decoded, stepped)
        observed, content = stepped
        self.done = observed.done
        self.rewards.add(observed.reward)
        return Reply(
            [codec.answer(content, decoded)], done=observed.done, reward=observed.reward, tool_calls=decoded.calls
        )

    def _step(self, payload: dict[str, Any]) -> tuple[Observed, str] | str:
        """The observation a step with this action gives and its text, or the validation error for the model."""
        raise NotImplementedError

    def reward(self) -> float | None:
        return self.rewards.total


class OpenEnvEpisode(OpenEnvTurns):
    """One OpenEnv environment object playing one episode (the `Episode` protocol)."""

    def __init__(self, env: OpenEnvEnvironment, obj: Any):
        super().__init__(env)
        self.obj = obj
        self.label = type(obj).__name__

    def reset(self, spec: EpisodeSpec, j: int) -> str | None:
        observed, text = self._observe(self.obj.reset(**reset_kwargs(self.obj.reset, spec, j)), "reset")
        self.done = observed.done
        return text or None

    def _step(self, payload: dict[str, Any]) -> tuple[Observed, str] | str:
        try:
            action = self.env.action_cls.model_validate(payload)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            errors: Any = exc.errors() if isinstance(exc, ValidationError) else [{"msg": str(exc)}]
            return format_validation_errors(errors)
        return self._observe(self.obj.step(action), "step")

    def _observe(self, obs: Any, method: str) -> tuple[Observed, str]:
        where = f"{self.label}.{method}"
        dump = getattr(obs, "model_dump", None)
        if not callable(dump):
            raise ProtocolBreach(
                f"{where} returned {type(obs).__name__}; expected an OpenEnv Observation (a pydantic model)"
            )
        fields = dump(exclude={"done", "reward"})  # read as attributes: a lying `done` must not trip pydantic's dump
        observed = check_observation(fields, getattr(obs, "done", None), getattr(obs, "reward", None), where)
        return observed, self.env.text.render(observed, self.env.schema_of(type(obs)), where)

    def snapshot(self) -> Any:
        return self.obj

    def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if callable(close):
            close()


class OpenEnvEnvironment:
    """`environment.openenv`: the class, its Action, and what its episodes share (the `Environment` protocol)."""

    has_reward = True  # OpenEnv observations carry rewards
    capacity: int | None = None  # objects in this process: no limit

    def __init__(
        self,
        env_cls: Callable[..., Any],
        action_cls: Any,
        name: str,
        kwargs: dict[str, Any],
        *,
        action_tool: str | None = None,
        observation_field: str | None = None,
    ):
        self.env_cls = env_cls
        self.action_cls = action_cls
        self.name = name
        self.kwargs = dict(kwargs)
        check_kwargs(env_cls, getattr(env_cls, "__name__", name), self.kwargs)
        self.codec = ActionCodec(action_cls.model_json_schema(), action_tool)
        self.tools = [self.codec.tool]
        self.text = ObservationText(observation_field)
        self._schemas: dict[type, dict[str, Any]] = {}

    def schema_of(self, observation_cls: Any) -> dict[str, Any]:
        if observation_cls not in self._schemas:
            self._schemas[observation_cls] = observation_cls.model_json_schema()
        return self._schemas[observation_cls]

    def episode(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(self, self.env_cls(**self.kwargs))

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def action_class_of(env_cls: Any, name: str) -> Any:
    """The Action class `step` takes: its `action` parameter's type hint, else the first type argument of
    `Environment[ActT, ObsT, StateT]` among the class's bases; ConfigError when neither names a pydantic model."""
    candidates = []
    try:
        candidates.append(typing.get_type_hints(env_cls.step).get("action"))
    except Exception:  # a hint that does not resolve: try the generic base
        pass
    for klass in getattr(env_cls, "__mro__", ()):
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args:
                candidates.append(args[0])
    for candidate in candidates:
        if isinstance(candidate, type) and callable(getattr(candidate, "model_json_schema", None)):
            return candidate
    raise ConfigError(
        f"{name}: cannot tell its Action class (step's `action` parameter has no pydantic type hint); "
        "set environment.action: my_env.py:MyAction"
    )


def build(cfg: Config) -> OpenEnvEnvironment:
    from ..user_functions import resolve_function

    env = cfg.environment
    assert env.openenv is not None, "built for environment.openenv only (environments.build_environment)"
    name = f"environment.openenv {env.openenv}"
    env_cls = resolve_function(env.openenv, "environment.openenv", "environment", ConfigError)
    for method in ("reset", "step"):
        if not callable(getattr(env_cls, method, None)):
            raise ConfigError(
                f"{name}: {getattr(env_cls, '__name__', env_cls)!r} has no {method} method; "
                "expected an OpenEnv Environment subclass"
            )
    if env.action is not None:
        action_cls = resolve_function(env.action, "environment.action", "Action class", ConfigError)
        if not callable(getattr(action_cls, "model_json_schema", None)):
            raise ConfigError(f"environment.action {env.action}: not a pydantic model (an OpenEnv Action subclass)")
    else:
        action_cls = action_class_of(env_cls, name)
    return OpenEnvEnvironment(
        env_cls, action_cls, name, env.kwargs, action_tool=env.action_tool, observation_field=env.observation_field
    )
