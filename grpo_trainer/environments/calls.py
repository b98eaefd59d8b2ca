"""Running environment code: concurrently, time-limited, never raising, never holding the process at exit.

Every call the episode loop makes into an environment (constructing it, reset, respond, reward, snapshot, close)
runs in `EnvCalls`, the trainer's one deadline utility (`grpo_trainer/deadline.py`: a pool of daemon threads; a
call past its limit is abandoned, reported at its limit, counted, and never holds the exit) with the environment's
limits. Threads, because environment code is the user's plain blocking Python (TRL's convention): they run many
episodes' calls at once (64 episodes whose step sleeps 50 ms take about 50 ms a round) and keep the objects in
this process, so reward functions can receive them (`environments=`, as TRL). The caller never touches the object
of an abandoned call again; more than `max_abandoned` abandoned calls still running means the environment hangs
as a rule, and the run stops with one line (`EnvironmentHangs`).

Process isolation, where a hung call must really be killed, is running the environment as an OpenEnv server.

Time limits (`EpisodeBudget`): each call gets `environment.step_timeout`, and no more than what is left of its
episode's `environment.episode_timeout`, which counts only the time spent in the episode's environment calls (not
wall time: a slow sampler must never fail a well-behaved episode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..deadline import Call, Outcome, UserCalls
from ..errors import UserError

STEP = "step"
EPISODE = "episode"
LIMIT_KEYS = "environment.step_timeout / environment.episode_timeout"

__all__ = ["EPISODE", "STEP", "EnvCalls", "EnvironmentHangs", "EpisodeBudget", "Outcome"]


class EnvironmentHangs(UserError):
    """Too many environment calls are still running after their timeout: the run stops (one line)."""


class EpisodeBudget:
    """One episode's time limits: `step` seconds per call, `episode` seconds of environment time in all."""

    def __init__(self, step: float, episode: float):
        self.step = step
        self.left = episode

    def timeout(self) -> tuple[float, str]:
        """The next call's limit and which limit it is."""
        return (self.step, STEP) if self.step <= self.left else (max(self.left, 0.0), EPISODE)

    def spend(self, seconds: float) -> None:
        self.left -= seconds


class EnvCalls(UserCalls):
    """`workers` daemon threads running one environment's calls (deadline.UserCalls with its limits).

    `name` names the environment in the one-line stop (`environment.factory my_env.py:GuessNumber`);
    `max_abandoned`: how many timed-out calls may still be running before the run stops."""

    def __init__(self, workers: int, name: str, max_abandoned: int):
        super().__init__(name, workers, max_abandoned, LIMIT_KEYS, stop=EnvironmentHangs, what="the environment hangs")

    def run(  # type: ignore[override]
        self, calls: list[tuple[Callable[[], Any], EpisodeBudget | float]], check: bool = True
    ) -> list[Outcome]:
        """Run every call, at most `workers` at once, each within its limit (a budget's next limit, charged with
        the time the call took; or a plain number of seconds); outcomes in the order of the calls. Whatever a
        call raises is its outcome, except a UserError (the environment says the run cannot go on: a remote server
        that stayed away, sessions that cannot be opened), raised here once every call has ended; raises
        EnvironmentHangs when too many abandoned calls are still running."""
        jobs = []
        for fn, limit in calls:
            seconds, kind = limit.timeout() if isinstance(limit, EpisodeBudget) else (float(limit), STEP)
            jobs.append(Call(fn, seconds, label=kind))
        outcomes = super().run(jobs, check=False)
        for (_, limit), outcome in zip(calls, outcomes):
            if isinstance(limit, EpisodeBudget):
                limit.spend(outcome.seconds)
        stop = next((o.exception for o in outcomes if isinstance(o.exception, UserError)), None)
        if stop is not None:
            raise stop
        if check:
            self.check()
        return outcomes
