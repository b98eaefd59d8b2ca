"""Environments, one object per conversation (`environment:`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import CHANGES_MEANING, _Section

ENVIRONMENT_KINDS = (
    "factory",
    "openenv",
    "url",
    "agent",
    "verifiers",
)  # environments.KINDS: the keys that choose an environment
ON_ERROR = Literal["zero", "none", "skip_group"]


class EnvironmentConfig(_Section):
    """One environment object per conversation (docs/environments.md). None of factory/openenv/url: the built-in
    stateless environment where `tools` names some, else none (single-turn rollouts)."""

    factory: str | None = Field(
        None,
        description="A class (or zero-argument callable) in TRL's convention, `my_env.py:GuessNumber` or "
        "`package.module:Class`: `reset(**row)` starts an episode (may return text appended to the prompt), public "
        "methods with type hints and an Args: docstring are the model's tools, optional `step(reply) -> (feedback, "
        "done)` answers plain replies, optional `get_reward()` scores the episode. One of factory/openenv/url/agent/verifiers.",
        json_schema_extra=CHANGES_MEANING,
    )
    openenv: str | None = Field(
        None,
        description="An OpenEnv `Environment` subclass (`my_env.py:GuessEnv`), run in this process. One of factory/openenv/url/agent/verifiers.",
        json_schema_extra=CHANGES_MEANING,
    )
    action: str | None = Field(
        None,
        description="environment.openenv: its Action class (default: the type hint of step()'s `action` parameter).",
        json_schema_extra=CHANGES_MEANING,
    )
    url: str | None = Field(
        None,
        description="A running OpenEnv server, `openenv+ws://HOST:PORT` (`openenv+wss://` for TLS), spoken to "
        "over its /ws protocol. One of factory/openenv/url/agent/verifiers.",
    )
    agent: str | None = Field(
        None,
        description="An agent program that calls the policy through an OpenAI-compatible endpoint, "
        "`my_agent.py:solve` or `package.module:solve`: `async def solve(row, *, base_url, api_key, model, seed)` (or a "
        "plain def, run in a thread) returning the episode's reward (a number, None, or a dict of named rewards: see "
        "reward_weights); its requests are the episode, trained token for token (docs/agents.md). One of "
        "factory/openenv/url/agent/verifiers.",
        json_schema_extra=CHANGES_MEANING,
    )
    verifiers: str | None = Field(
        None,
        description="A verifiers 0.4 (v1) environment, `my_env` (an importable module) or `path/to/my_env.py`, "
        "exporting one Taskset subclass (and optionally an Env and an in-process Harness): G episodes per task, each "
        "against the run's token endpoint, trained token for token; its taskset gives the prompts unless data.source "
        "is set explicitly; offline only (docs/agents.md). One of factory/openenv/url/agent/verifiers.",
        json_schema_extra=CHANGES_MEANING,
    )
    reward_weights: dict[str, float] = Field(
        default_factory=dict,
        description="environment.agent: the named rewards its solve function returns as a dict, with their weights; "
        "each is a reward `environment/<name>` (an unnamed key fails the episode). Empty: it returns one number, the "
        "`environment` reward.",
        json_schema_extra=CHANGES_MEANING,
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the factory / OpenEnv class (a fresh object per episode).",
        json_schema_extra=CHANGES_MEANING,
    )
    max_turns: int = Field(
        8,
        ge=1,
        description="Model turns per episode; an episode still going after them ends (`turns`).",
        json_schema_extra=CHANGES_MEANING,
    )
    step_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds per environment call (reset, step, a tool method, get_reward, close); an "
        "overrun ends the episode as a failure (environment/timeouts).",
    )
    episode_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds of environment time per episode (the sum of its calls, not wall time: a slow "
        "sampler never fails an episode); an overrun ends it as a failure. environment.agent: the agent's own time "
        "(wall time minus the time its requests spent in the sampler).",
    )
    concurrency: int = Field(
        64,
        ge=1,
        description="Environment calls run at once on each rank (threads); environment.agent: episodes played at once.",
    )
    on_error: ON_ERROR = Field(
        "zero",
        description="How an episode the environment failed (raised, hung, broke the protocol) is scored: `zero` (every "
        "reward 0), `none` (no opinion: left out of its group's statistics), `skip_group` (its whole group gets "
        "advantage 0). Counted in environment/errors and environment/timeouts.",
        json_schema_extra=CHANGES_MEANING,
    )
    reward_weight: float = Field(
        1.0,
        description="Weight of the environment's own reward (get_reward / OpenEnv rewards), logged as rewards/environment.",
        json_schema_extra=CHANGES_MEANING,
    )
    observation_chars: int = Field(
        4000,
        gt=0,
        description="An environment message is cut to this many characters (environment/observations_cut).",
        json_schema_extra=CHANGES_MEANING,
    )
    action_tool: str | None = Field(
        None,
        description="OpenEnv: the name of the tool the Action is offered as (default: the Action class name "
        "without `Action`, in snake_case).",
        json_schema_extra=CHANGES_MEANING,
    )
    observation_field: str | None = Field(
        None,
        description="OpenEnv: the observation field shown to the model (default: the only str field, else JSON).",
        json_schema_extra=CHANGES_MEANING,
    )
    reconnect_timeout: float = Field(
        60.0, gt=0, description="environment.url: seconds a server that went away is waited for before the run stops."
    )
    max_message_mb: float = Field(
        16.0, gt=0, description="environment.url: the largest frame accepted from the server."
    )

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call (multi-turn rollouts, see docs/tools.md): `python` (runs in the "
        "sandbox of `code_tests`) or a function `path/to/file.py:fn` / `package.module:fn`, described to the model "
        "from its signature and docstring. Calls are `<tool_call>{json}</tool_call>` (Hermes/Qwen); tool output "
        "tokens carry no loss. max_completion_length bounds model and tool tokens together. The tool keys were under "
        "`rollout` in earlier versions; those still load, with one deprecation line each.",
    )
    max_tool_turns: int = Field(4, ge=1, description="Rounds of tool calls per completion (with environment.tools).")
    tool_timeout: float = Field(
        10.0, gt=0, description="Wall seconds per tool call; an overrun is an error message to the model."
    )
    tool_output_chars: int = Field(1000, gt=0, description="A tool's output is cut to this many characters.")

    @property
    def kind(self) -> str | None:
        """Which key chose the environment (factory, openenv, url or agent), None without one."""
        chosen = self._chosen()
        return chosen[0] if chosen else None

    def _chosen(self) -> list[str]:
        return [k for k in ENVIRONMENT_KINDS if getattr(self, k) is not None]

    @property
    def spec(self) -> str | None:
        """What the user wrote for the kind (`my_env.py:GuessNumber`, `openenv+ws://...`)."""
        return None if self.kind is None else getattr(self, self.kind)

    @field_validator("url")
    @classmethod
    def _openenv_url(cls, url: str | None) -> str | None:
        """openenv+ws://HOST:PORT or openenv+wss://HOST:PORT, HOST a name, an IPv4 or a bracketed IPv6 address, PORT
        from 1 to 65535 (as rollout.vllm_server's URLs); refused when the config loads, not when the run connects."""
        if url is None:
            return url
        import urllib.parse

        expected = "expected openenv+ws://HOST:PORT or openenv+wss://HOST:PORT (IPv6: openenv+ws://[::1]:8001)"
        match = re.fullmatch(r"openenv\+wss?://(\[[0-9A-Fa-f:.]+\]|[^/:\s\[\]]+):(\d+)/?", url)
        if match is None:
            raise ValueError(expected)
        if not 1 <= int(match.group(2)) <= 65535:
            raise ValueError("the port must be a number from 1 to 65535")
        if match.group(1).startswith("["):
            import ipaddress

            try:
                ipaddress.IPv6Address(urllib.parse.urlsplit(url).hostname or "")
            except ValueError:
                raise ValueError(f"{match.group(1)} is not an IPv6 address") from None
        return url

    @model_validator(mode="after")
    def _one_kind(self):
        chosen = self._chosen()
        if len(chosen) > 1:
            raise ValueError(f"set one of factory, openenv, url, agent or verifiers, not {' and '.join(chosen)}")
        if self.kwargs and self.kind not in ("factory", "openenv"):
            raise ValueError(
                "environment.kwargs: constructor arguments for environment.factory or environment.openenv; set one"
            )
        if self.reward_weights and self.kind != "agent":
            raise ValueError("environment.reward_weights: the named rewards of environment.agent; set it")
        if self.action is not None and self.kind != "openenv":
            raise ValueError("environment.action: the Action class of environment.openenv; set it")
        return self
