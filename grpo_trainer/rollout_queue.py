"""The rollout schedule: which prompts are sampled when, with which weights, and the weight pushes.

`rollout.max_staleness` K decides how sampling and training interleave; it is the same loop for every K.

- K = 0 (the default): the synchronous loop. A step draws its prompts and samples them here and now, on the main
  thread, trains, then pushes the new weights. The queue adds no call and changes no order.
- K >= 1: batch t is sampled with the weights pushed after step t-K-1 (the initial ones while t <= K+1), in a
  background thread, while steps t-K .. t-1 train. So a step trains on completions exactly K weight versions
  older than the policy it updates (fewer at the start, and after a server lost its weights). The schedule:
    * is deterministic: which weights sample which batch depends on t and K only, never on timing;
    * runs one generation at a time per rank, and never a push during a generation: before every push each rank
      waits for its generation in flight, so the server never reloads weights under a running request;
    * keeps the background thread to HTTP requests (`engine.generate`): collectives, rewards, the ZeRO-3 gather
      and the push stay on the main thread, where every rank reaches them in the same order.
  After the update of step t: wait for the generation in flight, push version t, queue batch t+K+1. At the start
  of step t, batches t .. t+K are queued: t .. t+K-1 sampled, t+K being sampled.

A weight version is the optimizer step whose update produced the weights (0: the initial weights). Every
completion carries the version that sampled it (`Rollout.weight_versions`), and `take` lets none through that is
more than K versions older than the trainer's weights: such groups are left out, counted and sampled again with
the current weights. (The schedule never produces them; a server that lost its weights, or a resumed run with a
smaller K, can.)

Faults (an engine that `Reconnects`, today `vllm_server`; the engine waits up to
`rollout.vllm_server.reconnect_timeout` for a server that went away, and so does the queue, through its
`reconnect`, for one found gone between requests). A server that came back has lost the pushed weights (vLLM starts from its model folder): the engine's
`generate` raises `WeightsLost`. Every rank learns of it at the next point where all ranks meet (`take`,
`sample_more`, before a push), the current weights are pushed again, and every batch not yet trained is sampled
again: the restart happened at one moment for all ranks, and a batch that ended after it came from the wrong
weights on another rank. A server that does not come back stops the run with `ServerLostError`, one line naming
the URL; checkpoints are only written at the end of a step, so the last one is intact. A push the engine could
not finish (a ZeRO-3 gathered push raises `WeightsLost`: a second pass needs every rank) is made again by every
rank. A push past its deadline, or one whose probe finds other weights on a server (`PushFailed`,
rollout/push_checks.py), stops the run in one line naming the step, before the step's checkpoint is written.

Checkpoints record the prompts drawn but not yet trained (`state_dict`) and the completions of those sampled with
weights older than the checkpoint's (`settle_for_checkpoint`, `save_rollouts`: one file per rank; no wait, they were
sampled before the last push). The batch being sampled with the checkpoint's own weights is sampled again by a
resumed run, with those weights and the same seeds. So a resumed run trains on the very samples an uninterrupted
one does (bit for bit with rollout.seed_per_prompt), and no prompt is lost or trained twice. A batch that could not
be sampled (a server lost) is recorded by its prompts only, and sampled again with the resumed weights.

The queue is given what it uses, not the run: the engine, its settings (`QueueSettings`, from the config), the
batch geometry, the ranks' collectives, the task's prompts, the prompt sampler, and `push(version)`, which makes the
engine sample with the trainer's current weights (`weight_pusher`: the trainer's model, gathered piecewise under
ZeRO-3). What the engine can do it asks by capability (rollout.capability: `Reconnects`, `needs_weight_sync`,
`needs_episodes`).

Deliberately not here: dynamic sampling's decisions (collect.py asks for more with `sample_more`), rewards, and
how an engine talks to its server (rollout/).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .checkpoint import checkpoint_root
from .deadline import call_alone
from .errors import TrainingError, UserError
from .rollout import (
    PushFailed,
    Reconnects,
    Rollout,
    RolloutEngine,
    ServerGone,
    Sleeps,
    WeightsLost,
    capability,
    mix_seed,
    needs_episodes,
    needs_weight_sync,
)
from .rollout.weight_sync import zero3_gather

if TYPE_CHECKING:
    from .config import Config
    from .data import PromptSampler
    from .distributed import Collectives
    from .geometry import Geometry

logger = logging.getLogger("grpo_trainer")

OK, LOST, FATAL = 0, 1, 2  # a rank's state at a meeting point; the worst over ranks wins
ROLLOUTS_FILE = "rollouts_rank{rank}.pkl"  # a checkpoint's untrained batches, sampled (one file per rank)
MAX_RECOVERIES = 3  # weight losses in a row at one meeting point before giving up


class ServerLostError(TrainingError):
    """The rollout server went away and did not come back in time."""


@dataclass(frozen=True)
class QueueSettings:
    """What the schedule reads from the config."""

    max_staleness: int  # rollout.max_staleness, K
    prompts_per_step: int  # train.prompts_per_step: drawn per batch (every rank's)
    max_steps: int  # train.max_steps: nothing is queued past it
    seed: int  # the run's seed: each group's seed with rollout.seed_per_prompt
    seed_per_prompt: bool  # rollout.seed_per_prompt
    reconnect_timeout: float  # rollout.vllm_server.reconnect_timeout: the wait for a sampler found gone
    checkpoints: str  # where the run's checkpoints are (named when the server is lost for good)
    # environment.step_timeout: the limit on pickling a batch's environment objects for a checkpoint (their
    # __getstate__ / __reduce__ is user code, and may hang)
    save_timeout: float = 30.0

    @classmethod
    def of(cls, cfg: Config) -> QueueSettings:
        return cls(
            max_staleness=cfg.rollout.max_staleness,
            prompts_per_step=cfg.train.prompts_per_step,
            max_steps=cfg.train.max_steps,
            seed=cfg.seed,
            seed_per_prompt=cfg.rollout.seed_per_prompt,
            reconnect_timeout=cfg.rollout.vllm_server.reconnect_timeout,
            checkpoints=str(checkpoint_root(cfg.output_dir)),
            save_timeout=cfg.environment.step_timeout,
        )


class PromptSource(Protocol):
    """The task's side of sampling: prompt indices to token ids (task.Task)."""

    def prompt_ids(self, indices: list[int]) -> list[list[int]]: ...

    def episode_spec(self, index: int, group_seed: int, episode_id: str) -> Any: ...


@dataclass
class _Batch:
    step: int  # the step that trains it
    prompts: list[int]  # the whole batch's prompt indices (every rank's; the same list on every rank)
    future: Future | None = None  # this rank's rollout once queued (K >= 1); None: sampled when taken
    version: int = -1  # the weight version it is (being) sampled with, once queued


class _Worker:
    """One daemon thread running jobs one at a time, in order (a daemon: a request in flight never holds up exit)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="grpo-rollouts", daemon=True)
        self._thread.start()

    def submit(self, fn) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        self._jobs.put((None, None))

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if fn is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001  handed to the main thread through the future
                    future.set_exception(exc)


class RolloutQueue:
    """The rollouts of the run's steps, sampled on schedule (module docstring). `push(version)` makes the engine
    sample with the trainer's current weights (every rank calls it; `weight_pusher`).

    Versions: during step t, before its update, the trainer holds version t-1; after it, version t."""

    def __init__(
        self,
        engine: RolloutEngine,
        settings: QueueSettings,
        *,
        geometry: Geometry,
        comm: Collectives,
        task: PromptSource,
        sampler: PromptSampler,
        push: Callable[[int], None],
    ):
        self.engine, self.settings, self.push = engine, settings, push
        self.geometry, self.comm, self.task, self.sampler = geometry, comm, task, sampler
        self.max_staleness = settings.max_staleness
        self.version = 0  # the weights the sampler holds, as far as the trainer knows
        self.pending: deque[_Batch] = deque()  # drawn, not yet trained, in step order
        self.reconnects = capability(engine, Reconnects)  # a sampler in another process, which can restart
        self._worker = _Worker() if self.max_staleness else None
        self._broken = False  # a queued generation failed: later ones must not run on a server in an unknown state
        self._lock = threading.Lock()
        self._busy_since: float | None = None  # sampling (this rank) since then
        self._busy = 0.0  # seconds sampled since the last report
        self._waited = 0.0  # seconds the main thread waited for rollouts since the last report
        self._window = time.perf_counter()
        self._step_metrics: dict[str, float] = {}
        self._ready: dict[int, bytes] = {}  # steps -> this rank's pickled completions, for the checkpoint being saved

    # ------------------------------------------------------------------ the loop's calls
    def start(self, step: int) -> None:
        """Before the first step of this process (`step` = the last one done): push the trainer's weights, since
        the sampler may hold others (a server that outlived an earlier run; a resumed run's engine, built from the
        model folder), then queue the first batches."""
        self.push(step)
        self.version = step
        self._refill(step)

    def take(self, step: int) -> tuple[list[int], Rollout]:
        """This rank's prompts of step `step`'s batch and their completions: sampled now (K = 0), or the queued
        ones (K >= 1). None of them is more than K versions older than the trainer's weights (version step-1)."""
        if not self.pending:  # K = 0 draws here, at the same point as a loop without a queue
            self.pending.append(_Batch(step, self._draw()))
        batch = self.pending[0]
        mine = self.geometry.my_prompts(batch.prompts)
        rollout = (
            self._sample_now(mine, step, 0, current=step - 1)
            if batch.future is None
            else self._queued_result(batch, step)
        )
        self.pending.popleft()
        if self.max_staleness:
            rollout = self._within_staleness(mine, rollout, step)
        return mine, rollout

    def sample_more(self, step: int, draw: int) -> tuple[list[int], Rollout]:
        """Dynamic sampling's extra round `draw` of step `step`: the next prompts, sampled now with the current
        weights (after this rank's queued generations)."""
        mine = self.geometry.my_prompts(self._draw())
        return mine, self._sample_now(mine, step, draw, current=step - 1)

    def before_update(self) -> None:
        """The step's samples are taken: an engine that `Sleeps` (vLLM in this process) frees its memory for the
        update (it wakes itself before it samples or takes weights again)."""
        if (sleeper := capability(self.engine, Sleeps)) is not None:
            sleeper.sleep()

    def after_update(self, step: int) -> None:
        """Step `step` updated the weights: push them as version `step` (once every rank's generation in flight has
        ended), and queue what keeps the pipeline K+1 batches deep."""
        recovered = self._worker is not None and self._meet(step, list(self._queued()), current=step)
        if not recovered:  # a recovery pushed these very weights already
            self.push(step)
            self.version = step
        self._refill(step)

    def step_metrics(self) -> dict[str, float]:
        """This step's rollout metrics, then a new measuring window: staleness (K >= 1) and, for engines that sample
        outside the trainer, the main thread's wait for rollouts and the sampler's idle time."""
        now = time.perf_counter()
        with self._lock:
            busy = self._busy + (now - self._busy_since if self._busy_since is not None else 0.0)
            self._busy, self._busy_since = 0.0, (now if self._busy_since is not None else None)
        out = self._step_metrics
        if needs_weight_sync(self.engine):  # docs/async.md: every engine that samples outside the training model
            out = {
                **out,
                "timing/rollout_wait": self._waited,
                "timing/server_idle": max(0.0, now - self._window - busy),
            }
        self._step_metrics, self._waited, self._window = {}, 0.0, now
        return out

    def state_dict(self) -> dict:
        """What a checkpoint records: the prompts drawn but not trained, one list per step, in order."""
        return {"pending": [batch.prompts for batch in self.pending]}

    def settle_for_checkpoint(self) -> list[int]:
        """Every rank (a collective): which untrained batches the checkpoint holds the completions of, by step, and
        this rank's completions of them made ready for `save_rollouts`. A batch sampled with weights older than the
        current ones is held: it was sampled before the last push (each rank waited for it), and a resumed run could
        not sample it again with those weights. A batch sampled with the current weights (the one queued after the
        last push, which may still be running) is not waited for: a resumed run samples it again with the same
        weights, the checkpoint's, and the same seeds. A batch some rank cannot save (it failed; its completions or
        its environment objects do not pickle, e.g. one holding a connection) is held by none: its prompts are
        sampled again."""
        ready: dict[int, bytes] = {}
        for batch in self.pending:
            future = batch.future
            if future is None or batch.version >= self.version or not future.done() or future.exception() is not None:
                continue
            saved = self._pickled(batch.step, future.result())
            if saved is not None:
                ready[batch.step] = saved
        missing = self.comm.max(torch.tensor([0.0 if b.step in ready else 1.0 for b in self.pending]))
        held = [b.step for b, m in zip(self.pending, missing.tolist()) if not m]
        self._ready = {step: ready[step] for step in held}
        return held

    def _pickled(self, step: int, rollout: Rollout) -> bytes | None:
        """A batch's completions with their environment objects (Rollout leaves those out of its own pickle: they
        never cross ranks), or None where they cannot be saved (the batch is sampled again on resume)."""
        return self._environment_code(
            lambda: pickle.dumps((rollout, rollout.environments), protocol=pickle.HIGHEST_PROTOCOL),
            f"checkpoint: batch {step}'s completions cannot be saved",
            "sampled again on resume",
        )

    def _environment_code(self, fn: Callable[[], Any], failed: str, then: str) -> Any:
        """`fn()`, which pickles or unpickles a batch and so runs its environment objects' own code (`__reduce__`,
        `__getstate__`, `__setstate__`), within environment.step_timeout; None where it raised or ran over, logged
        in one line (`failed (why): then`)."""
        outcome = call_alone(
            fn,
            self.settings.save_timeout,
            name=failed,
            limit_key="environment.step_timeout",
            stop=UserError,
            label="environment.step_timeout",
        )
        if outcome.ok:
            return outcome.value
        why = outcome.error or f"not done within environment.step_timeout ({self.settings.save_timeout:g} s)"
        logger.warning("%s (%s): %s", failed, why, then)
        return None

    def save_rollouts(self, folder: Path) -> None:
        """This rank's completions of the batches `settle_for_checkpoint` chose, into `folder` (one file per rank)."""
        with (folder / ROLLOUTS_FILE.format(rank=self.geometry.rank)).open("wb") as f:
            pickle.dump(self._ready, f, protocol=pickle.HIGHEST_PROTOCOL)
        self._ready = {}

    def load_state_dict(self, state: dict, step: int, folder: Path | None = None) -> None:
        """A checkpoint's pending prompts (saved after step `step`), sampled before any new draw; where the
        checkpoint in `folder` holds the completions of some (`sampled`: their steps), those are trained as they are.
        `folder` None (a resume onto another number of processes): every batch is sampled again."""
        self.pending = deque(_Batch(step + 1 + i, list(prompts)) for i, prompts in enumerate(state.get("pending", [])))
        sampled = set(state.get("sampled", []))
        if not sampled or folder is None:
            return
        path = folder / ROLLOUTS_FILE.format(rank=self.geometry.rank)
        if not path.is_file():
            raise TrainingError(f"{folder} records sampled batches but has no {path.name}: resume from another")
        with path.open("rb") as f:
            saved = pickle.load(f)  # this run's own checkpoint, verified against its manifest: written by save_rollouts
        held = [batch for batch in self.pending if batch.step in sampled]
        rollouts = [self._unpickled(batch.step, saved[batch.step]) for batch in held]
        # A batch some rank cannot load is sampled again by every rank (a step trains one batch on all of them).
        missing = self.comm.max(torch.tensor([float(r is None) for r in rollouts] + [0.0]))
        for batch, rollout, lost in zip(held, rollouts, missing.tolist()):
            if rollout is not None and not lost:
                future: Future = Future()
                future.set_result(rollout)
                batch.future = future

    def _unpickled(self, step: int, saved: bytes) -> Rollout | None:
        """A saved batch with its environment objects (what the reward functions get, as the batch left them), or
        None where they cannot be loaded (the batch is sampled again)."""
        loaded = self._environment_code(
            lambda: pickle.loads(saved), f"resume: batch {step}'s saved completions cannot be loaded", "sampled again"
        )
        if loaded is None:
            return None
        rollout, environments = loaded
        rollout.environments = environments
        return rollout

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ schedule
    def _draw(self) -> list[int]:
        """The next train.prompts_per_step prompt indices (every rank advances the same sampler)."""
        return self.sampler.next_indices(self.settings.prompts_per_step)

    def _refill(self, current: int) -> None:
        """With the sampler at version `current`: queue the untrained batches not queued yet, then new ones up to
        step current+K+1 (none past train.max_steps), all to be sampled with version `current`."""
        worker = self._worker
        if worker is None:
            return
        for batch in self.pending:  # recorded by a checkpoint, or to sample again after a server lost its weights
            if batch.future is None:
                batch.future = self._submit(worker, batch)
        last = min(current + self.max_staleness + 1, self.settings.max_steps)
        while (self.pending[-1].step if self.pending else current) < last:
            batch = _Batch((self.pending[-1].step if self.pending else current) + 1, self._draw())
            batch.future = self._submit(worker, batch)
            self.pending.append(batch)

    def _queued(self):
        return (batch.future for batch in self.pending if batch.future is not None)

    def _submit(self, worker: _Worker, batch: _Batch) -> Future:
        mine, version = self.geometry.my_prompts(batch.prompts), self.version
        batch.version = version
        return worker.submit(lambda: self._generate(mine, batch.step, 0, version, queued=True))

    def _within_staleness(self, mine: list[int], rollout: Rollout, step: int) -> Rollout:
        """Leave out and sample again every group with a completion more than K versions old; log the staleness."""
        g = self.geometry.group_size
        assert rollout.weight_versions is not None  # _generate sets it on every rollout
        age = [step - 1 - v for v in rollout.weight_versions]
        stale = [j for j in range(len(mine)) if max(age[j * g : (j + 1) * g]) > self.max_staleness]
        if int(self.comm.max(torch.tensor([float(len(stale))]))[0]):  # every rank resamples together
            for j in stale:
                logger.warning(
                    "step %d: prompt %d was sampled by weights %d versions old (rollout.max_staleness=%d): "
                    "left out and sampled again",
                    step,
                    mine[j],
                    max(age[j * g : (j + 1) * g]),
                    self.max_staleness,
                )
            fresh = self._sample_now([mine[j] for j in stale], step, 0, current=step - 1, positions=stale)
            parts = [rollout.select(list(range(j * g, (j + 1) * g))) for j in range(len(mine))]
            for n, j in enumerate(stale):
                parts[j] = fresh.select(list(range(n * g, (n + 1) * g)))
            rollout = Rollout.concat(parts)
        assert rollout.weight_versions is not None
        trained = self.comm.gather(torch.tensor([step - 1 - v for v in rollout.weight_versions], dtype=torch.float32))
        self._step_metrics.update(
            {
                "rollout/staleness_mean": float(trained.mean()),
                "rollout/staleness_max": float(trained.max()),
                "rollout/stale_resampled": float(self.comm.sum(torch.tensor([float(len(stale))]))[0]),
            }
        )
        return rollout

    # ------------------------------------------------------------------ sampling and recovery
    def _sample_now(
        self, mine: list[int], step: int, draw: int, current: int, positions: list[int] | None = None
    ) -> Rollout:
        """Sample on the main thread, after this rank's queued generations; recover from a lost server and retry."""
        for _ in range(MAX_RECOVERIES + 1):
            if self._worker is not None:
                self._wait(list(self._queued()))
            tick = time.perf_counter()
            try:
                rollout, status, error = self._generate(mine, step, draw, self.version, positions=positions), OK, None
            except BaseException as exc:  # noqa: BLE001  every rank must hear of it before anyone raises
                (status, error), rollout = self._classify(exc), None
            self._waited += time.perf_counter() - tick
            if not self._resolve(step, status, error, current):
                assert rollout is not None  # every rank is OK, this one too
                return rollout
        raise self._too_many_losses(step)

    def _queued_result(self, batch: _Batch, step: int) -> Rollout:
        """The queued rollout of `batch`, once every rank's is in (recovering from a lost server on the way)."""
        for _ in range(MAX_RECOVERIES + 1):
            assert batch.future is not None  # queued by _refill (again, after a recovery)
            if not self._meet(step, [batch.future], current=step - 1):
                return batch.future.result()
        raise self._too_many_losses(step)

    def _meet(self, step: int, waiting_for: list[Future], current: int) -> bool:
        """Wait for `waiting_for`, then agree with every rank on the state of all queued generations. Returns
        whether a server had lost its weights (and they were pushed again, and the untrained batches queued again)."""
        self._wait(waiting_for)
        status, error = OK, None
        for future in self._queued():
            if future.done() and future.exception() is not None:
                status, error = max((status, error), self._classify(future.exception()), key=lambda s: s[0])
        return self._resolve(step, status, error, current)

    def _resolve(self, step: int, status: int, error: BaseException | None, current: int) -> bool:
        """Act on every rank's worst state: OK -> False; a server that lost its weights -> push version `current`
        (the trainer's weights now) again, queue every untrained batch again -> True; fatal -> every rank raises."""
        if self.reconnects is None:  # nothing to agree on: an error is a bug, and raises here
            if error is not None:
                raise error
            return False
        agreed = int(self.comm.max(torch.tensor([float(status)]))[0])
        if agreed == FATAL:
            if isinstance(error, ConnectionError):
                raise ServerLostError(
                    f"{error}; stopping: the last checkpoint in {self.settings.checkpoints} "
                    "is intact (resume with checkpoint.resume=auto once the server is back)"
                ) from None
            raise error or ServerLostError(f"step {step}: another rank's rollouts failed (see its error); stopping")
        if agreed == OK:
            return False
        if self._worker is not None:
            self._wait(list(self._queued()))
        logger.warning(
            "step %d: the rollout server lost its weights (restarted?): pushing version %d again and "
            "sampling the %d untrained batches again",
            step,
            current,
            len(self.pending),
        )
        self.push(current)
        self.version, self._broken = current, False
        for batch in self.pending:
            batch.future = None
        self._refill(current)
        return True

    def _too_many_losses(self, step: int) -> ServerLostError:
        return ServerLostError(
            f"step {step}: the rollout server lost its weights {MAX_RECOVERIES + 1} times in a row; stopping"
        )

    def _wait(self, futures: list[Future]) -> None:
        tick = time.perf_counter()
        wait_for_futures(futures)
        self._waited += time.perf_counter() - tick

    def _generate(
        self,
        mine: list[int],
        step: int,
        draw: int,
        version: int,
        positions: list[int] | None = None,
        queued: bool = False,
    ) -> Rollout:
        """G completions for each of this rank's prompts `mine`, stamped with the weight version sampling them.
        With rollout.seed_per_prompt, each group's seed is a function of (seed, step, round, position in the
        whole batch), so samples do not depend on the number of ranks."""
        if queued and self._broken:
            raise WeightsLost([], version, "not sampled: an earlier queued generation failed")
        g = self.geometry.group_size
        first = self.geometry.rank * self.geometry.prompts_per_rank
        places = [first + j for j in (positions or range(len(mine)))]  # in the whole batch: rank-independent
        seeds = [mix_seed(self.settings.seed, step, draw, p) for p in places] if self.settings.seed_per_prompt else None
        # Environments reset from the row and a seed of the group's, whether or not sampling is seeded per prompt.
        episodes = None
        if needs_episodes(self.engine):
            episodes = [
                self.task.episode_spec(i, mix_seed(self.settings.seed, step, draw, p), f"s{step}-d{draw}-p{p}")
                for i, p in zip(mine, places)
            ]
        with self._sampling():
            try:
                rollout = (
                    self.engine.generate(self.task.prompt_ids(mine), g, seeds=seeds, episodes=episodes)
                    if mine
                    else Rollout([], [])
                )
            except BaseException:
                self._broken = self._broken or queued
                raise
        rollout.weight_versions = [version] * len(rollout.completion_ids)
        return rollout

    @contextlib.contextmanager
    def _sampling(self):
        """Count the time this rank's sampler is busy (for timing/server_idle)."""
        with self._lock:
            self._busy_since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._busy += time.perf_counter() - self._busy_since
                self._busy_since = None

    def _classify(self, error: BaseException) -> tuple[int, BaseException]:
        """LOST for a server that is back without our weights, FATAL otherwise. The engine waits for a server that
        went away in the middle of sampling; one that drops a request it does not wait on (`ServerGone`) is
        waited for here, up to the same reconnect time."""
        if isinstance(error, WeightsLost):
            return LOST, error
        if isinstance(error, ServerGone) and self.reconnects is not None:
            timeout = self.settings.reconnect_timeout
            try:  # whatever waiting raises (a URL that now answers but is not vLLM) is this rank's state, not an escape
                back = self.reconnects.reconnect(timeout)  # before the ranks agree (_resolve): they would wait for us
            except Exception as exc:
                return FATAL, exc
            if back:
                return LOST, error
            return FATAL, ConnectionError(f"{error} (it did not come back within {timeout:g}s)")
        return FATAL, error


# ---------------------------------------------------------------------------------------------- weight pushes


def weight_pusher(
    engine: RolloutEngine, comm: Collectives, model: Callable[[], torch.nn.Module], accelerator: Any, checkpoints: str
) -> Callable[[int], None]:
    """The queue's `push`: `push_weights` of the trainer's `model()` (the bare causal LM), gathered piecewise under
    the accelerator's ZeRO-3 (`weight_sync.zero3_gather`)."""
    gather = zero3_gather(accelerator)
    return lambda version: push_weights(engine, comm, model, version, gather=gather, checkpoints=checkpoints)


def push_weights(
    engine: RolloutEngine,
    comm: Collectives,
    model: Callable[[], torch.nn.Module],
    version: int,
    *,
    gather: Any = None,
    checkpoints: str = "the output folder",
) -> None:
    """Make the engine sample with the trainer's current weights (`model()`, the bare causal LM, asked for only
    here), labelled `version`, if it keeps its own copy. Every rank calls it: a server is pushed to by the main process, and under ZeRO-3 every rank takes part
    in gathering the weights piece by piece (`gather`, weight_sync.zero3_gather's: one decoder layer whole at a
    time, never the whole model). The engine waits for a server that went away; a push it could not finish
    (`WeightsLost`) is made again by every rank. Every rank returns, or raises, together. (Under ZeRO-3 a rank that
    raises in the middle of the gathers leaves the others inside one: only the engine can avoid that, and does for
    a server that goes away, `VLLMServerEngine.sync_weights`.) `checkpoints`: named when the server is lost."""
    if not needs_weight_sync(engine):
        return  # the hf engine samples from the training model: nothing to push, nothing to gather
    bare_lm = model()
    for _ in range(MAX_RECOVERIES + 1):
        status, error = OK, None  # type: tuple[int, Exception | None]
        try:
            engine.sync_weights(bare_lm, version=version, gather=gather)
        except WeightsLost as exc:
            status, error = LOST, exc
        except Exception as exc:  # noqa: BLE001  every rank hears of it before any raises (none waits in the barrier)
            status, error = FATAL, exc  # a ConnectionError: the engine waited for the server, which did not come back
        agreed = int(comm.max(torch.tensor([float(status)]))[0])  # also the barrier after a push
        if agreed == OK:
            return
        if agreed == FATAL:
            if isinstance(error, PushFailed):  # past its deadline, or the probe found other weights on a server
                raise PushFailed(
                    f"step {version}: {error}; stopping: the last checkpoint in {checkpoints} is intact (resume with "
                    "checkpoint.resume=auto)"
                ) from None
            if error is not None and not isinstance(error, ConnectionError):
                raise error  # not a server that went away: a bug or a misconfigured server, as is
            raise ServerLostError(
                f"pushing weights version {version}: {error or 'failed on the main process (see its error)'}; stopping: "
                f"the last checkpoint in {checkpoints} is intact (resume with checkpoint.resume=auto "
                "once the server is back)"
            ) from None
        logger.warning("pushing weights version %d: %s; pushing again", version, error or "another rank's push failed")
    raise ServerLostError(f"pushing weights version {version} failed {MAX_RECOVERIES + 1} times in a row; stopping")
