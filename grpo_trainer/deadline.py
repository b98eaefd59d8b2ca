"""Running user code under a deadline: the one way the trainer calls code it does not own.

Tools (`environment.tools`), reward functions with a `timeout`, environment calls (constructing an object, reset,
respond, reward, snapshot, close) and the checks an environment class is read with all run here, in a pool of
**daemon** threads (`UserCalls`). What every caller gets, the same for all of them:

- A call past its limit takes the deadline path: its outcome is `timed_out` and its time is the limit (never the
  limit plus a margin). It cannot be killed (it is Python in this process): it is *abandoned*, its thread keeps
  running and a new worker takes its place (the pool's capacity does not shrink). The caller never touches what
  the call was working on again (an environment object whose call was abandoned is not closed, scored or reused).
- Daemon threads, never `concurrent.futures` ones: those are joined when the interpreter exits, so one call that
  never returns would hold the trainer's exit forever. A daemon thread cannot.
- A call's limit may leave out time it spends waiting on the trainer (`Call.excluded`: an agent's requests waiting
  for the policy's answers, agents/engine.py); the deadline moves on by that time as it grows.
- Abandoned calls still running are counted (`abandoned`, and `abandoned_total` since the pool started); more of
  one function's than the pool's bound means the function hangs as a rule, not by accident, and the run stops
  with one line naming the function (`CallsHang`, a UserError: exit status 2) instead of piling up threads.
- Whatever a call raises is its outcome, `SystemExit` included: `sys.exit()` in user code is an error of that code,
  never a silent end of the run. (`KeyboardInterrupt` reaches only the main thread; `run_inline` lets it through.)

Not covered, because no thread can do it: `os._exit()` (or a crash in C code) in user code ends the whole process
at once, with no Python code run after it. `guard_os_exit` makes a Python-level `os._exit` during the run say so
and end the process with a failure status instead of the status the user code passed (0 would read as success),
except in threads marked by `raise_on_os_exit` (an agent's: `UserCalls(catch_os_exit=True)`, the agent engine's
event loop), where it raises `OsExitCalled`, an error of that call like sys.exit; a C-level `_exit` or a fatal
signal is beyond it: the exit status, or the missing "done" line, is the only trace.
Process isolation, where a hung call must really be killed, is running an environment as an OpenEnv server, and
the `python` tool's sandbox.

`end_process_if_held` is the other half of "never keeps the process from exiting": threads that user code
started itself (not ours) and left running as non-daemon would hold the interpreter's exit after "done" forever;
the CLI then ends the process itself, with the run's status, once everything is written and the interpreter's
own exit has had `EXIT_GRACE` seconds (so idle `concurrent.futures` workers and exit hooks end as usual).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import UserError

TIMEOUT = "timeout"  # an Outcome's `timed_out` when the caller gives no label of its own


class CallsHang(UserError):
    """Too many calls of one function are still running after their limit: the run stops (one line)."""


@dataclass
class Outcome:
    """What one call gave: its value, or the one-line error it raised (and the exception itself, which says what
    kind of failure it is: a lost connection, or a UserError that stops the run), or that it timed out."""

    value: Any = None
    error: str | None = None  # "ValueError: unlucky" (first line of the message)
    exception: BaseException | None = None  # what the call raised, when it raised
    timed_out: str | None = None  # the call's label (e.g. which limit it ran into) when it timed out
    seconds: float = 0.0  # time the call ran (its limit, when it timed out)

    @property
    def ok(self) -> bool:
        return self.error is None and self.timed_out is None


@dataclass
class Call:
    """One call to make: `fn()` within `limit` seconds (math.inf: none). `name` names the function in the stop
    message (default: the pool's name); `label` is the outcome's `timed_out` when it overruns."""

    fn: Callable[[], Any]
    limit: float
    name: str | None = None
    label: str = TIMEOUT
    # Seconds of the call's running time that do not count against its limit, read as it runs (it may only grow):
    # an agent's time waiting for the policy's answers (agents/engine.py). None: all of it counts.
    excluded: Callable[[], float] | None = None


class _Job:
    __slots__ = ("call", "started", "finished", "outcome", "abandoned")

    def __init__(self, call: Call):
        self.call = call
        self.started: float | None = None
        self.finished = False
        self.outcome: Outcome | None = None
        self.abandoned = False


class UserCalls:
    """A pool of up to `workers` daemon threads running user calls, each within its limit; see the module docstring.

    `name` names the function (or the environment) in the one-line stop, e.g. `rewards.0 (slow_judge)`;
    `limit_key` the config key of the limit (`environment.tool_timeout`), for the same message; `max_abandoned`: how
    many timed-out calls may still be running before the run stops (`stop`, a UserError subclass, is raised, its
    message ending with `what`)."""

    def __init__(
        self,
        name: str,
        workers: int,
        max_abandoned: int,
        limit_key: str,
        stop: type[UserError] = CallsHang,
        what: str = "the function hangs",
        catch_os_exit: bool = False,
    ):
        self.catch_os_exit = catch_os_exit  # os._exit in a call raises OsExitCalled there (raise_on_os_exit)
        self.name = name
        self.what = what
        self.workers = workers
        self.max_abandoned = max_abandoned
        self.limit_key = limit_key
        self.stop = stop
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._threads = 0  # workers alive and not abandoned
        self._outstanding = 0  # calls queued or running, not yet finished or abandoned (of every caller's run)
        self._abandoned: Counter[str] = Counter()  # abandoned calls still running, by function name
        self.abandoned_total = 0  # calls abandoned since the pool started (finished since or not)

    @property
    def abandoned(self) -> int:
        """Timed-out calls whose threads are still running."""
        with self._changed:
            return sum(self._abandoned.values())

    def call(self, fn: Callable[[], Any], limit: float | None, label: str = TIMEOUT) -> Outcome:
        """One call (None: no limit), in a worker; raises `stop` when too many abandoned calls are still running."""
        return self.run([Call(fn, math.inf if limit is None else limit, label=label)])[0]

    def run(self, calls: Sequence[Call], check: bool = True) -> list[Outcome]:
        """Run every call, at most `workers` at once, each within its limit from when it starts; outcomes in the
        order of the calls. With `check`, raises `stop` when more than `max_abandoned` are still running."""
        jobs = [_Job(c) for c in calls]
        for job in jobs:
            if job.call.limit <= 0:  # no time left for it: the call is not made
                job.finished, job.outcome = True, Outcome(timed_out=job.call.label)
            else:
                with self._changed:
                    self._outstanding += 1
                self._queue.put(job)
        # Enough workers for these calls and those of other threads' runs still going (callers may run at once).
        with self._changed:
            outstanding = self._outstanding
        self._ensure_workers(min(self.workers, outstanding))
        with self._changed:
            while True:
                now = time.perf_counter()
                waits = []
                for job in jobs:
                    if job.finished or job.started is None:
                        continue
                    excluded = job.call.excluded() if job.call.excluded is not None else 0.0
                    left = job.started + job.call.limit + excluded - now
                    if left <= 0:
                        self._abandon(job)
                    elif math.isfinite(left):
                        waits.append(left)
                if all(job.finished for job in jobs):
                    break
                # Woken by every start and finish; otherwise at the first deadline of a running call.
                self._changed.wait(timeout=min(waits) if waits else None)
        outcomes = [job.outcome for job in jobs if job.outcome is not None]
        assert len(outcomes) == len(jobs), "every call ends with an outcome (finished, failed or abandoned)"
        if check:
            self.check()
        return outcomes

    def check(self) -> None:
        """Raise `stop`, naming the function, when more of one function's calls than the bound are still running
        past their limit (counted per function: a pool may run several, e.g. the tools of `environment.tools`)."""
        with self._changed:
            if not self._abandoned:
                return
            name, running = self._abandoned.most_common(1)[0]
            if running <= self.max_abandoned:
                return
        raise self.stop(
            f"{name}: {running} calls are still running after their timeout ({self.limit_key}): {self.what}; stopping"
        )

    def _abandon(self, job: _Job) -> None:
        """Give up on a running call (under the lock): its outcome is a timeout at its limit; a new worker takes
        its place."""
        job.abandoned = True
        job.finished = True
        self._outstanding -= 1
        job.outcome = Outcome(timed_out=job.call.label, seconds=job.call.limit)
        self._abandoned[job.call.name or self.name] += 1
        self.abandoned_total += 1
        self._threads -= 1
        self._start_worker()

    def _ensure_workers(self, wanted: int) -> None:
        with self._changed:
            while self._threads < wanted:
                self._start_worker()

    def _start_worker(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name="grpo-user-call", daemon=True).start()

    def _work(self) -> None:
        if self.catch_os_exit:
            raise_on_os_exit()
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._changed:
                job.started = time.perf_counter()
                self._changed.notify_all()
            outcome = _outcome(job.call.fn)
            with self._changed:
                if not job.abandoned:
                    self._outstanding -= 1
                if job.abandoned:  # too late: the caller went on; this thread was replaced, so it ends
                    name = job.call.name or self.name
                    self._abandoned[name] -= 1
                    if not self._abandoned[name]:
                        del self._abandoned[name]
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


def call_alone(
    fn: Callable[[], Any], limit: float, *, name: str, limit_key: str, stop: type[UserError], label: str
) -> Outcome:
    """One user call that the run cannot go on without (importing a user's file, building an environment), in a
    worker of its own, within `limit`: its outcome, os._exit caught as an error; a UserError it raised (the caller's
    own refusal) is raised again."""
    calls = UserCalls(name, 1, 1, limit_key, stop=stop, catch_os_exit=True)
    try:
        outcome = calls.call(fn, limit, label=label)
    finally:
        calls.close()
    if isinstance(outcome.exception, UserError):
        raise outcome.exception
    return outcome


def run_inline(fn: Callable[[], Any]) -> Outcome:
    """`fn()` in the calling thread, with no limit (user code the caller must run in its own thread, such as a
    profiler's `on_step_end`, or a reward with no timeout), its outcome as from a pool: `SystemExit` is an error of
    that code. KeyboardInterrupt (Ctrl-C reaches the main thread) goes through."""
    start = time.perf_counter()
    outcome = _outcome(fn, reraise=(KeyboardInterrupt,))
    outcome.seconds = time.perf_counter() - start
    return outcome


def _outcome(fn: Callable[[], Any], reraise: tuple[type[BaseException], ...] = ()) -> Outcome:
    try:
        return Outcome(value=fn())
    except reraise:
        raise
    except BaseException as exc:  # noqa: BLE001 (the user's code: what it raises, SystemExit too, is its outcome)
        return Outcome(error=one_line(exc), exception=exc)


def one_line(exc: BaseException) -> str:
    """`ValueError: unlucky` (the first line of the message); `SystemExit: 0` for sys.exit(0)."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


# ---------------------------------------------------------------------------------------------- the process's end
_real_exit = os._exit
_guarded_pid: int | None = None
_threads = threading.local()  # .raise_exit: os._exit in this thread raises OsExitCalled (raise_on_os_exit)


class OsExitCalled(BaseException):
    """`os._exit(status)` called, under `guard_os_exit`, in a thread marked by `raise_on_os_exit` (an agent's): raised
    there instead of ending the process, so it ends what that thread was running (one episode). A BaseException, as
    SystemExit is: code that catches Exception does not swallow it."""

    def __init__(self, status: int):
        super().__init__(f"os._exit({status}) was called")
        self.status = status


def raise_on_os_exit() -> None:
    """Mark the calling thread: under `guard_os_exit`, a Python-level `os._exit` in it raises `OsExitCalled` (the
    call's outcome is then an error, as for sys.exit) instead of ending the process. For threads that run only user
    code whose failure must end only what it was doing (agents' episodes: UserCalls(catch_os_exit=True), the
    agent engine's players' loop)."""
    _threads.raise_exit = True


@contextlib.contextmanager
def guard_os_exit() -> Iterator[None]:
    """While a command runs, a Python-level `os._exit(status)` in this process (user code in an
    environment or a tool: the trainer's own code never calls it then) prints one line saying so and ends the
    process with `status`, or 1 for 0: a run that vanished is never a success (in a thread marked by
    `raise_on_os_exit`, it raises `OsExitCalled` there instead). Child processes (a fork inherits the guard) are
    left alone. A C-level _exit or a signal cannot be seen here (see the module docstring). Re-entrant: an inner
    guard (the agent engine's, in a run the CLI already guards) changes nothing."""
    global _guarded_pid
    if _guarded_pid == os.getpid():
        yield
        return
    _guarded_pid = os.getpid()
    os._exit = _guarded_exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = _real_exit
        _guarded_pid = None


def _guarded_exit(status: int) -> None:
    if os.getpid() == _guarded_pid and getattr(_threads, "raise_exit", False):
        raise OsExitCalled(status)
    if os.getpid() == _guarded_pid:
        code = status if status else 1
        thread = threading.current_thread().name
        _flush()
        with contextlib.suppress(Exception):
            os.write(
                2,
                f"error: os._exit({status}) was called in thread {thread!r} before the run finished (user code: an "
                f"environment, a tool or a reward); the run did not finish; exiting with status {code}\n".encode(),
            )
        _real_exit(code)
    _real_exit(status)


def held_by(threads: Sequence[threading.Thread] | None = None) -> list[str]:
    """The names of the live non-daemon threads other than the main one: what would keep the interpreter from
    exiting (it joins them first)."""
    live = threading.enumerate() if threads is None else threads
    main = threading.main_thread()
    return [t.name for t in live if t is not main and not t.daemon and t.is_alive()]


EXIT_GRACE = 10.0  # seconds the interpreter's own exit may take once a command is over (its threads, atexit hooks)
EXIT_GRACE_ENV = "GRPO_TRAINER_EXIT_GRACE"  # overrides it (the tests wait less)


def end_process_if_held(status: int, grace: float | None = None) -> None:
    """Called last, when a command is over and everything is written (metrics, trackers, checkpoints, the model):
    the process is going to exit with `status`. The interpreter first joins every non-daemon thread (and runs its
    exit hooks, which end idle `concurrent.futures` workers); a thread user code left running would hold that
    forever. A daemon watchdog started here ends the process with `status` if it is still alive `grace` seconds
    later, naming the threads that held it; a normal exit, sooner, ends the watchdog with the process.
    `grace`: None reads `GRPO_TRAINER_EXIT_GRACE`, else `EXIT_GRACE`."""
    if grace is None:
        grace = float(os.environ.get(EXIT_GRACE_ENV, EXIT_GRACE))

    def watch() -> None:
        time.sleep(grace)
        held = held_by()
        named = ", ".join(sorted(held)[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        message = (
            f"the process is still running {grace:g} s after the command ended, held by "
            + (
                f"{len(held)} non-daemon thread(s) ({named}; started by user code or a library it called)"
                if held
                else "its exit handlers"
            )
            + f"; ending it now (status {status})"
        )
        _flush()
        with contextlib.suppress(Exception):
            os.write(2, f"warning: {message}\n".encode())
        _real_exit(status)

    threading.Thread(target=watch, name="grpo-exit-watchdog", daemon=True).start()


def _flush() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
