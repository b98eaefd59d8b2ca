"""Running environment code: concurrently, time-limited, never raising, never holding the process at exit.

Every call the episode loop makes into an environment (constructing it, reset, respond, reward, snapshot, close)
runs here, in a pool of **daemon** threads. Why threads, and why daemon ones:

- Environment code is the user's plain blocking Python (TRL's convention); threads run many episodes' calls at
  once (64 episodes whose step sleeps 50 ms take about 50 ms a round) and keep the objects in this process, so
  reward functions can receive them (`environments=`, as TRL).
- A call that overruns its timeout cannot be killed: it is *abandoned*. Its thread keeps running and a new worker
  replaces it (the pool's capacity does not shrink); the caller never touches that episode's object again.
  `concurrent.futures` threads are joined at interpreter exit, so a call that never returns would hold the
  trainer's exit forever; daemon threads do not (rewards.py times out reward functions the same way).
- Abandoned threads that are still running are counted; more than `max_abandoned` means the environment hangs
  as a rule, not by accident, and the run stops with one line (`EnvironmentHangs`) instead of piling up threads.

Process isolation, where a hung call must really be killed, is running the environment as an OpenEnv server.

Time limits (`EpisodeBudget`): each call gets `environment.step_timeout`, and no more than what is left of its
episode's `environment.episode_timeout`, which counts only the time spent in the episode's environment calls (not
wall time: a slow sampler must never fail a well-behaved episode).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

STEP = "step"
EPISODE = "episode"


class EnvironmentHangs(UserError):
    """Too many environment calls are still running after their timeout: the run stops (one line)."""


@dataclass
class Outcome:
    """What one call gave: its value, or the one-line error it raised (and the exception itself, which says what
    kind of failure it is: a lost connection, or a UserError that stops the run), or that it timed out."""

    value: Any = None
    error: str | None = None  # "ValueError: unlucky" (first line of the message)
    exception: BaseException | None = None  # what the call raised, when it raised
    timed_out: str | None = None  # STEP or EPISODE: which limit it ran into
    seconds: float = 0.0  # time the call ran (up to its timeout)

    @property
    def ok(self) -> bool:
        return self.error is None and self.timed_out is None


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


class _Job:
    __slots__ = ("fn", "limit", "kind", "started", "finished", "outcome", "abandoned")

    def __init__(self, fn: Callable[[], Any], limit: float, kind: str):
        self.fn, self.limit, self.kind = fn, limit, kind
        self.started: float | None = None
        self.finished = False
        self.outcome: Outcome | None = None
        self.abandoned = False


class EnvCalls:
    """A pool of `workers` daemon threads running environment calls; see the module docstring.

    `name` names the environment in the one-line stop (`environment.factory my_env.py:GuessNumber`);
    `max_abandoned`: how many timed-out calls may still be running before the run stops."""

    def __init__(self, workers: int, name: str, max_abandoned: int):
        self.workers = workers
        self.name = name
        self.max_abandoned = max_abandoned
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._threads = 0  # workers alive and not abandoned
        self._abandoned = 0  # abandoned calls still running

    @property
    def abandoned(self) -> int:
        """Timed-out calls whose threads are still running."""
        with self._changed:
            return self._abandoned

    def run(self, calls: list[tuple[Callable[[], Any], EpisodeBudget | float]]) -> list[Outcome]:
        """Run every call, at most `workers` at once, each within its limit (a budget's next limit, charged with
        the time the call took; or a plain number of seconds); outcomes in the order of the calls. Whatever a
        call raises is its outcome, except a UserError (the environment says the run cannot go on: a remote server
        that stayed away, sessions that cannot be opened), raised here once every call has ended; raises
        EnvironmentHangs when too many abandoned calls are still running."""
        jobs = []
        for fn, limit in calls:
            seconds, kind = limit.timeout() if isinstance(limit, EpisodeBudget) else (float(limit), STEP)
            jobs.append(_Job(fn, seconds, kind))
        for job in jobs:
            if job.limit <= 0:  # the episode's budget is spent: the call is not made
                job.finished, job.outcome = True, Outcome(timed_out=job.kind)
            else:
                self._queue.put(job)
        self._ensure_workers(min(self.workers, sum(not job.finished for job in jobs)))
        with self._changed:
            while True:
                now = time.perf_counter()
                waits = []
                for job in jobs:
                    if job.finished or job.started is None:
                        continue
                    left = job.started + job.limit - now
                    if left <= 0:
                        self._abandon(job, now)
                    else:
                        waits.append(left)
                if all(job.finished for job in jobs):
                    break
                # Woken by every start and finish; otherwise at the first deadline of a running call.
                self._changed.wait(timeout=min(waits) if waits else None)
        outcomes = [job.outcome for job in jobs if job.outcome is not None]
        assert len(outcomes) == len(jobs), "every call ends with an outcome (finished, failed or abandoned)"
        for (_, limit), outcome in zip(calls, outcomes):
            if isinstance(limit, EpisodeBudget):
                limit.spend(outcome.seconds)
        stop = next((o.exception for o in outcomes if isinstance(o.exception, UserError)), None)
        if stop is not None:
            raise stop
        if self.abandoned > self.max_abandoned:
            raise EnvironmentHangs(
                f"{self.name}: {self.abandoned} calls are still running after their timeout "
                f"(environment.step_timeout / environment.episode_timeout): the environment hangs; stopping"
            )
        return outcomes

    def _abandon(self, job: _Job, now: float) -> None:
        """Give up on a running call (under the lock): its outcome is a timeout, a new worker takes its place."""
        job.abandoned = True
        job.finished = True
        job.outcome = Outcome(timed_out=job.kind, seconds=job.limit)
        self._abandoned += 1
        self._threads -= 1
        self._start_worker()

    def _ensure_workers(self, wanted: int) -> None:
        with self._changed:
            while self._threads < wanted:
                self._start_worker()

    def _start_worker(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name="environment-call", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._changed:
                job.started = time.perf_counter()
                self._changed.notify_all()
            outcome = _call(job.fn)
            with self._changed:
                if job.abandoned:  # too late: the caller went on; this thread was replaced, so it ends
                    self._abandoned -= 1
                    return
                outcome.seconds = time.perf_counter() - job.started
                job.outcome, job.finished = outcome, True
                self._changed.notify_all()

    def close(self) -> None:
        """Stop the idle workers (abandoned ones end when their call returns, or with the process)."""
        with self._changed:
            for _ in range(self._threads):
                self._queue.put(None)
            self._threads = 0


def _call(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=fn())
    except BaseException as exc:  # noqa: BLE001 (the environment's code: whatever it raises ends its episode only)
        message = str(exc).strip().splitlines()
        return Outcome(error=f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__, exception=exc)
