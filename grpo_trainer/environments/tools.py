"""Tools a model can call during a rollout (`environment.tools`): what they are, how calls are parsed and run.

A tool is a name, the JSON schema the chat template shows the model (its
`tools=` argument), and a function from the call's arguments to the text that
goes back to the model as the tool message. Two kinds:

- `python`, built in: runs the model's code in the sandbox of the `code_tests`
  reward (rewards/sandbox.py: separate process, namespaces, rlimits, no network,
  a wall-clock kill from outside) and returns what it printed; a traceback's last
  line or a timeout notice if it failed.
- a user's function, named like a custom reward (`path/to/file.py:fn` or
  `package.module:fn`); its schema comes from its signature and docstring
  (transformers' `get_json_schema`, which needs type hints and an Args section).
  It runs in the trainer's process (it is the user's own code, trusted), with
  the same wall-clock limit, under the trainer's deadline utility (deadline.py):
  one that overruns is reported to the model as an error at its limit and
  abandoned in a daemon thread (it never holds the process's exit); too many
  still running stops the run naming the tool.

Calls are parsed from the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(several per turn allowed). Whatever the model writes, parsing and running never raise: a malformed call,
an unknown tool, bad arguments or a failing run all become an error message to the model and a counted tool
error. "Bad arguments" means arguments that do not fit the tool's signature (checked before it runs); a
TypeError raised inside a tool is reported as the tool's own failure, like any other exception. Every output
is cut to `environment.tool_output_chars`.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..deadline import Call, UserCalls

if TYPE_CHECKING:
    from ..config import EnvironmentConfig

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TOOL = "python"
SELF_TIMED_GRACE = 5.0  # seconds after environment.tool_timeout before a self-timed tool (the sandbox) is abandoned
ABANDONED_PER_WORKER = 4  # a user's tool calls still running past their timeout, per worker, before the run stops

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL,
        "description": "Run a Python program in a sandbox (no network, no files kept) and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program; print() the results you need."}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    run: Callable[..., str]  # keyword arguments from the call -> text for the model; may raise
    self_timed: bool = False  # ends itself at the tool timeout (the sandbox): the deadline is only its backstop


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    name: str
    output: str  # the tool message's content
    error: bool  # a malformed call, unknown tool, bad arguments, failed run or timeout
    seconds: float = 0.0


def parse_tool_calls(text: str) -> list[ToolCall | ToolResult]:
    """The calls in one assistant turn, in order; a call that cannot be understood is already its error result."""
    calls: list[ToolCall | ToolResult] = []
    for match in TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            calls.append(ToolResult("?", "error: the tool call is not closed with </tool_call>", error=True))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(
                ToolResult(
                    "?", f"error: the tool call is not valid JSON ({exc.msg} at character {exc.pos})", error=True
                )
            )
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates serialise the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(
                ToolResult(
                    str(name or "?"), 'error: a tool call is {"name": <string>, "arguments": <object>}', error=True
                )
            )
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def tool_message(name: str, content: str) -> dict[str, Any]:
    """The message that takes a tool's output back to the model (the chat templates' `tool` role); the one form
    every environment answers a tool call with."""
    return {"role": "tool", "name": name, "content": content}


def cut(text: str, limit: int) -> str:
    """At most `limit` characters: the start, and a note of how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters]"


class ToolBox:
    """The configured tools, and the one place calls are run: concurrently, time-limited, never raising."""

    def __init__(self, tools: list[Tool], timeout: float, output_chars: int, max_workers: int = 16):
        self.tools = {t.name: t for t in tools}
        self.timeout = timeout
        self.output_chars = output_chars
        self.max_workers = max_workers
        self._calls = UserCalls(
            "environment.tools", max_workers, ABANDONED_PER_WORKER * max_workers, "environment.tool_timeout"
        )

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def run(self, calls: list[ToolCall | ToolResult]) -> list[ToolResult]:
        """Run every call (parse errors pass through); results in the order of the calls. Each runs under the
        deadline (grpo_trainer/deadline.py): a user's function past `timeout` is reported to the model as an error
        at its limit and abandoned in its daemon thread; the `python` tool's sandbox kills its own program at
        `timeout`, so its deadline is a backstop `SELF_TIMED_GRACE` s later. Raises CallsHang (the run stops, one
        line naming the tool) when more than `max_abandoned` abandoned calls are still running."""
        pending = [c for c in calls if isinstance(c, ToolCall)]
        if not pending:
            return list(calls)  # type: ignore[arg-type]
        ran = iter(
            self._calls.run(
                [Call(functools.partial(self.call, c), self._limit(c.name), name=self._name(c.name)) for c in pending]
            )
        )
        results = []
        for c in calls:
            if isinstance(c, ToolResult):
                results.append(c)
                continue
            outcome = next(ran)
            if outcome.timed_out is not None:
                results.append(
                    ToolResult(
                        c.name, f"error: {c.name} did not return within {outcome.seconds:g} s", True, outcome.seconds
                    )
                )
            elif outcome.error is not None:  # what self.call does not catch: SystemExit, KeyboardInterrupt
                results.append(ToolResult(c.name, f"error: {outcome.error}", True, outcome.seconds))
            else:
                results.append(outcome.value)
        return results

    def _limit(self, name: str) -> float:
        tool = self.tools.get(name)
        return self.timeout + (SELF_TIMED_GRACE if tool is not None and tool.self_timed else 0.0)

    def _name(self, name: str) -> str:
        return f"environment.tools {name}" if name in self.tools else "environment.tools"

    def call(self, call: ToolCall) -> ToolResult:
        """One call, in the caller's thread (no time limit of its own: the caller's); never raises."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools)
            return ToolResult(call.name, f"error: there is no tool {call.name!r} (tools: {known})", error=True)
        start = time.perf_counter()
        try:
            inspect.signature(tool.run).bind(**call.arguments)  # a TypeError here is the call's, not the tool's
        except TypeError as exc:
            return ToolResult(call.name, f"error: bad arguments for {call.name}: {exc}", error=True)
        try:
            output, error = tool.run(**call.arguments), False
        except ToolFailed as exc:
            output, error = str(exc), True
        except Exception as exc:  # the user's function failed: the model is told, training goes on
            output, error = f"error: {type(exc).__name__}: {exc}", True
        return ToolResult(call.name, cut(str(output), self.output_chars), error, time.perf_counter() - start)


class ToolFailed(Exception):
    """A tool ran and failed; the message is what the model is told (e.g. the program's traceback)."""


def python_tool(timeout: float) -> Tool:
    """The built-in `python` tool: the sandbox of the `code_tests` reward, with its default limits and `timeout`."""
    from ..rewards import builtin_module

    sandbox = builtin_module("sandbox")  # the built-in rewards' copy, never a user's `rewards` package

    limits = sandbox.Limits(wall_seconds=timeout)

    def run(code: str) -> str:
        if not isinstance(code, str):
            raise ToolFailed(
                f"error: bad arguments for {PYTHON_TOOL}: 'code' must be a string, not {type(code).__name__}"
            )
        result = sandbox.run_python(code, limits=limits)
        stdout = result.stdout.decode("utf-8", errors="replace")
        if result.completed:
            return stdout
        if result.timed_out:
            raise ToolFailed(stdout + f"error: the program did not finish within {timeout:g} s")
        if result.output_overflow:
            raise ToolFailed(stdout + "error: the program printed too much and was stopped")
        lines = result.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise ToolFailed(
            stdout + (lines[-1] if lines else f"error: the program exited with status {result.returncode}")
        )

    return Tool(PYTHON_TOOL, PYTHON_SCHEMA, run, self_timed=True)


def function_tool(spec: str, where: str) -> Tool:
    """A user's function as a tool; its schema from its signature and docstring."""
    from transformers.utils import get_json_schema

    from ..errors import ConfigError
    from ..user_functions import resolve_function

    fn = resolve_function(spec, where, "tool", ConfigError, builtins=[PYTHON_TOOL])
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigError(f"{where}: {spec!r} is a generator (it yields); a tool returns the text the model reads")
    try:
        schema = get_json_schema(fn)
    except Exception as exc:
        raise ConfigError(
            f"{where}: cannot describe {spec!r} to the model ({exc}); a tool function needs type hints on every "
            "argument and a docstring with an Args: section"
        ) from None
    return Tool(schema["function"]["name"], schema, fn)


def build_toolbox(env: EnvironmentConfig) -> ToolBox | None:
    """`environment.tools` -> the tool box (None without tools); names must be unique."""
    from ..errors import ConfigError
    from ..user_functions import first_duplicate

    if not env.tools:
        return None
    tools = [
        python_tool(env.tool_timeout) if spec == PYTHON_TOOL else function_tool(spec, f"environment.tools.{i}")
        for i, spec in enumerate(env.tools)
    ]
    duplicate = first_duplicate([t.name for t in tools])
    if duplicate:
        raise ConfigError(f"environment.tools: two tools are named {duplicate!r}")
    return ToolBox(tools, env.tool_timeout, env.tool_output_chars)
