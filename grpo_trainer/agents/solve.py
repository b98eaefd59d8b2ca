"""`environment.agent: my_agent.py:solve`: any program that calls the OpenAI API, as a `Player` (producer.py).

    async def solve(row, *, base_url, api_key, model, seed) -> float | dict[str, float] | None

(or a plain `def`, run in a daemon thread of deadline.UserCalls within the episode's limit). It talks to the
endpoint at `base_url` with `api_key` (the episode's own key) as often as it likes, with the `openai` package or
plain HTTP; its requests are the episode, its return value the episode's reward: a number (or None: no opinion) is
the `environment` reward, weighted by environment.reward_weight; a dict gives named rewards `environment/<name>`,
weighted by environment.reward_weights (which must name every key it may return). `row` is the dataset row (its
own copy), `seed` the episode's seed for the program's own randomness. Reward functions in `rewards:` score the
episode too: they receive its messages as the completion (the last chat request's messages and the reply).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .endpoint import EpisodeHandle
from .producer import Played, PlayerEnvironment

if TYPE_CHECKING:
    from ..config import Config

KEY = "environment.agent"
ARGUMENTS = ("base_url", "api_key", "model", "seed")


class SolvePlayer:
    """A solve function as a Player: its return value is the episode's reward; the endpoint's record is trained."""

    def __init__(self, fn: Callable[..., Any], spec: str, reward_weights: dict[str, float] | None = None):
        self.fn = fn
        self.name = f"{KEY} {spec}"
        self.is_async = inspect.iscoroutinefunction(fn)
        self.reward_names = dict(reward_weights or {})

    async def play(self, row: dict[str, Any], episode: EpisodeHandle, seed: int) -> Played:
        from .engine import call_sync

        kwargs = {"base_url": episode.base_url, "api_key": episode.api_key, "model": episode.model, "seed": seed}
        if self.is_async:
            reward = await self.fn(row, **kwargs)
        else:
            reward = await call_sync(functools.partial(self.fn, row, **kwargs))
            if inspect.isawaitable(reward):  # a plain def returning a coroutine (a decorated async function)
                reward = await reward
        return Played(reward=reward)


def resolve_solve(spec: str) -> Callable[..., Any]:
    """The function `environment.agent` names, checked to take (row, *, base_url, api_key, model, seed): a
    ConfigError naming the key otherwise, before any model loads."""
    from ..user_functions import resolve_function

    fn = resolve_function(spec, KEY, "agent", ConfigError)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    try:
        signature.bind({}, **dict.fromkeys(ARGUMENTS))
    except TypeError as exc:
        takes = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values())
        raise ConfigError(
            f"{KEY} {spec}: {getattr(fn, '__name__', spec)}({takes}) cannot be called as "
            f"solve(row, *, base_url, api_key, model, seed): {exc}"
        ) from None
    return fn


def build(cfg: Config) -> PlayerEnvironment:
    """environment.agent's environment: its solve function as the run's player."""
    spec = cfg.environment.agent or ""
    return PlayerEnvironment(SolvePlayer(resolve_solve(spec), spec, cfg.environment.reward_weights))
