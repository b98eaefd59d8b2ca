"""Preemption: a signal asks the run to stop at the next step boundary, with a checkpoint.

SLURM and Kubernetes send SIGTERM (or SIGUSR1 ahead of a time limit) and allow a grace period before
SIGKILL. The handler only records the signal, so a signal can arrive anywhere, twice, or during a save,
without harm. At the end of each step all ranks agree (a max over ranks: one rank's signal stops every
rank at the same step), a checkpoint is saved at that step, and the process exits with
PREEMPTED_EXIT_CODE; `checkpoint.resume: auto` then continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

logger = logging.getLogger("grpo_trainer")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL ("try again later"): a requeue script can tell it from a crash


class StopRequests:
    """Installs handlers for `names` (e.g. ["SIGTERM", "SIGUSR1"]) while active; remembers the first signal."""

    def __init__(self, names: list[str]):
        self.signals = [getattr(signal, name) for name in names]
        self.received: signal.Signals | None = None
        self._previous: dict[int, signal._HANDLER] = {}  # what each signal's handler was before

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not the main thread: no preemption signal handlers")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            logger.warning("received %s: stopping after this step with a checkpoint", self.received.name)

    def agreed(self, comm) -> bool:
        """Whether any rank received a signal (a collective: every rank calls it at the same point)."""
        return bool(comm.max(torch.tensor([0.0 if self.received is None else 1.0]))[0])
