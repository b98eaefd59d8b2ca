"""Environments: one conversation per environment object, the model's turns answered by it.

An *episode* is one completion played against one environment object: reset from the prompt's dataset row and the
group's seed, the model's turns answered (tool calls and plain replies), ended by the environment, the model or
the length limit, scored by the environment (`reward()`) beside the config's reward functions. The multi-turn
loop (`episodes.py`, `EpisodeEngine`) talks to episodes through the `Episode` protocol (`protocol.py`) and to
nothing else, so every kind of environment runs on the one loop:

- `tools_env.py`: the built-in stateless environment of `environment.tools` (and the sandboxed `python` tool);
- `class_env.py`: a class in the TRL convention (`environment.factory: my_env.py:GuessNumber`);
- `openenv.py`: an OpenEnv `Environment` subclass in this process (`environment.openenv`);
- `openenv_ws.py`: a remote OpenEnv server over its `/ws` protocol (`environment.url`).

Each kind is an `Environment`: what is the same for all its episodes (name, tool schemas, whether it scores)
and a maker of fresh `Episode`s (one object per episode, never reused: an episode's result cannot depend on what
an object did before, which keeps resumed runs exact). `build_environment(cfg)` picks the kind from the config;
kinds are imported lazily (`KINDS`), so nothing of OpenEnv's is imported unless it is chosen.

The loop runs every adapter call through `calls.EnvCalls` (daemon threads, timeouts): an adapter is written as
plain blocking code, and any exception it raises, a timeout, or a breach of this protocol ends that episode as an
*environment failure*, scored by `environment.on_error`. Model-side mistakes (a malformed call, an unknown tool,
an invalid action) are never failures: the adapter answers them with a message to the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .protocol import (
    ENDED_BY_ENVIRONMENT,
    ENDED_BY_LENGTH,
    ENDED_BY_MODEL,
    ENDED_BY_TURNS,
    ENDINGS,
    FAILED_DISCONNECT,
    FAILED_ERROR,
    FAILED_TIMEOUT,
    FAILURES,
    Environment,
    Episode,
    EpisodeRecord,
    EpisodeSpec,
    ProtocolBreach,
    Reply,
    check_kwargs,
    flag,
    reward_number,
)

if TYPE_CHECKING:
    from ..config import Config

# The kinds, by the config key that selects them: "module:function" building an Environment from the Config,
# imported only when chosen.
KINDS: dict[str, str] = {
    "factory": "grpo_trainer.environments.class_env:build",
    "openenv": "grpo_trainer.environments.openenv:build",
    "url": "grpo_trainer.environments.openenv_ws:build",
    "agent": "grpo_trainer.agents.solve:build",  # a Player (agents/producer.py), played by agents/engine.py
    "verifiers": "grpo_trainer.agents.verifiers_env:build",  # a Player too: a verifiers 0.4 environment
}
TOOLS = "grpo_trainer.environments.tools_env:build"  # the built-in one: `environment.tools` alone selects it


MASK64 = 2**64 - 1
ENV_PART = 2**20 + 1  # mixed into a group's seed for its environment seed: above any G, so never a completion's


def environment_seed(group_seed: int) -> int:
    """The environment seed of a group whose sampling seed would be `group_seed` (mix_seed(cfg.seed, step, draw,
    position), computed whether or not rollout.seed_per_prompt is set), in [0, 2**31): the queue re-draws the same
    (step, draw, position) on resume, so the episodes are the same. mix_seed is linear, so its low and high bits
    alone collide for simple parts (0 and 2**62; 0 and 1): they are scrambled first (splitmix64's finalizer)."""
    from ..seeds import mix_seed

    z = (mix_seed(group_seed, ENV_PART) + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 33


def build_environment(cfg: Config) -> Environment | None:
    """The configured environment: `environment:`'s kind, else the built-in tools environment when
    `environment.tools` is set, else None (single-turn rollouts)."""
    kind = cfg.environment.kind
    if kind is None and not cfg.environment.tools:
        return None
    module, _, function = (TOOLS if kind is None else KINDS[kind]).partition(":")
    return getattr(importlib.import_module(module), function)(cfg)


__all__ = [
    "ENDED_BY_ENVIRONMENT",
    "ENDED_BY_LENGTH",
    "ENDED_BY_MODEL",
    "ENDED_BY_TURNS",
    "ENDINGS",
    "FAILED_DISCONNECT",
    "FAILED_ERROR",
    "FAILED_TIMEOUT",
    "FAILURES",
    "KINDS",
    "Environment",
    "Episode",
    "EpisodeRecord",
    "EpisodeSpec",
    "ProtocolBreach",
    "Reply",
    "build_environment",
    "check_kwargs",
    "environment_seed",
    "flag",
    "reward_number",
]
