"""The run's output folder: checked before anything loads, held by one run at a time, a finished run recognised.

- `check(output_dir)`: a folder the run can create and write, or one line naming `output_dir` and the path
  (a file, a path under a file, a folder this user cannot write). Run before any model loads, so that a typo
  costs seconds, not a model load followed by a raw OSError.
- `claimed(output_dir)`: the folder for the run's whole life. Two runs writing one folder at once would
  interleave their metrics and overwrite each other's config, checkpoints and model, and both would exit 0;
  the second is refused in one line naming the folder and the holder (its pid, host and start time).
  The lock is an advisory `flock` on `OUTPUT_DIR/.grpo_trainer.lock`, taken by the main process only
  (the other ranks write nothing there and wait only for its verdict). The kernel drops a flock when its
  holder dies, so a run killed with SIGKILL leaves no stale lock, only a file with a dead pid in it, which the
  next run takes over. The file is removed when the run ends. Forked children (reward pools) close their copy
  of the descriptor, so a child that outlives its run does not keep the folder locked.
- `finished_run(cfg)`: a run that already reached `train.max_steps` in its folder (running the same notebook
  cell, or the same command, twice): its final metrics, without loading a model or training 0 steps.

Deliberately not done: locking anything but the output folder (two runs may share a model, data or a cache,
which they only read), and waiting for the holder to finish (a run can last days: the user decides).
Over NFS, Linux implements flock with NFS locks, which work across hosts; a file system without locks gets a
warning and no lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError

logger = logging.getLogger("grpo_trainer")

LOCK_FILE = ".grpo_trainer.lock"
_held_fds: set[int] = set()  # lock descriptors this process holds (closed in forked children)


def check(output_dir: str | Path) -> Path:
    """`output_dir` as a folder this process can create and write into, or a ConfigError naming it.

    Nothing is created here (`claimed` creates the folder). Root passes the permission check everywhere but
    on read-only file systems; creating the folder, then the lock file, says what else is wrong."""
    path = Path(output_dir)
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"output_dir: {path} is a file, not a folder; name a folder (it is created if missing)")
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"output_dir: {path} cannot be created: {existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            where = "it" if existing == path else str(existing)
            raise ConfigError(f"output_dir: cannot write to {path}: {where} is not writable by this user")
    except OSError as exc:  # e.g. a folder on the way that this user may not even look into
        raise ConfigError(f"output_dir: cannot use {path}: {exc.strerror or exc}") from None
    return path


@contextlib.contextmanager
def claimed(
    output_dir: str | Path, is_main_process: bool = True, share: Callable[[str | None], str | None] | None = None
) -> Iterator[Path]:
    """Check `output_dir`, create it and hold its lock for the block (main process only).

    `share(verdict)` gives every rank the main process's verdict (None, or the refusal's message), so all ranks
    stop together with the same line; by default Accelerate's broadcast when there are several processes.
    """
    share = share or _broadcast_from_main
    path = Path(output_dir)
    lock: _FolderLock | None = None
    verdict = None
    made = is_main_process and not path.exists()
    if is_main_process:
        try:
            check(path)
            _create(path)
            lock = _FolderLock(path)
            lock.acquire()
        except ConfigError as exc:
            verdict = str(exc)
        except OSError as exc:  # a full disk or quota while writing the lock's record: one line, on every rank
            verdict = f"output_dir: cannot write to {path}: {exc.strerror or exc}"
    verdict = share(verdict)
    try:
        if verdict is not None:
            raise ConfigError(verdict)
        yield path
    finally:
        if lock is not None:
            lock.release()
        if made:  # a run that stopped before writing anything (a refusal in preflight) leaves no empty folder
            with contextlib.suppress(OSError):
                path.rmdir()


def _create(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir: cannot create {path}: {exc.strerror or exc}") from None


def _broadcast_from_main(verdict: str | None) -> str | None:
    from .distributed import partial_state

    state = partial_state()
    if state.num_processes == 1:
        return verdict
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([verdict], from_process=0)[0]


class _FolderLock:
    """An exclusive, non-blocking flock on OUTPUT_DIR/LOCK_FILE; the file says who holds it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ConfigError(f"output_dir: cannot write to {self.folder}: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _describe_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ConfigError(
                        f"output_dir: {self.folder} is in use by another run ({holder}); wait for it to end, or "
                        "give this run another output_dir"
                    ) from None
                logger.warning(
                    "output_dir: %s cannot be locked (%s): a second run into it at once would not be detected",
                    self.folder,
                    exc.strerror or exc,
                )
                return
            # The holder removes the file as it releases the lock: locking a removed file locks nothing.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        _held_fds.add(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # before unlocking: whoever opened it meanwhile sees it is gone and tries again
        _held_fds.discard(self.fd)
        os.close(self.fd)
        self.fd = None


def _describe_holder(fd: int) -> str:
    """`pid 123 on host h since ...` from the lock file (empty while the holder is still writing it)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {record['pid']} on host {record['host']}, since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def _close_in_child() -> None:
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's descriptor (and lock) is untouched
    _held_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def finished_run(cfg, is_main_process: bool = True) -> dict[str, Any] | None:
    """The last metrics record of the run in `cfg.output_dir` when it already reached `train.max_steps` (said in
    one line); None when there is training, or a final model, still to do.

    Running a finished run again would load the model, train 0 steps, save the model again and return no
    metrics. A settings change that resuming would refuse is refused here too (the metrics would describe
    another run); `checkpoint.resume: never` starts over as always.
    """
    from . import checkpoint as ckpt
    from .metrics import read_metrics
    from .model_card import CARD
    from .run import setup_logging

    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    candidates = ckpt.complete_checkpoints(cfg.output_dir) if resume == "auto" else [Path(resume)]
    if all(_saved_step(c) < cfg.train.max_steps for c in candidates):
        return None  # steps to go: resume verifies (hashes) the checkpoint, once
    found, _ = ckpt.find_resume_checkpoint(cfg.output_dir, resume)
    if found is None:
        return None
    saved = ckpt.read_trainer_state(found)
    step = int(saved["step"])
    if step < cfg.train.max_steps:
        return None
    if cfg.checkpoint.save_final_model and not (Path(cfg.output_dir) / "model" / CARD).is_file():
        # Stopped between its last checkpoint and the end of its final model (the card is written last, after every
        # weight file): resuming saves the model.
        return None
    ckpt.check_resume_compatible(
        ckpt.resolved_today(saved.get("config", {}), absolute_paths=True),
        cfg.model_dump(mode="json"),
        None,
        1,
        cfg.checkpoint.force_resume,
    )
    setup_logging(cfg, is_main_process)
    logger.info(
        "the run in %s is complete (checkpoint %s, step %d; train.max_steps=%d): nothing to train; raise "
        "train.max_steps to train on, or set checkpoint.resume=never to start over",
        cfg.output_dir,
        found.name,
        step,
        cfg.train.max_steps,
    )
    history = read_metrics(found) if (found / ckpt.METRICS_HISTORY).is_file() else []
    return history[-1] if history else {}


def _saved_step(checkpoint: Path) -> int:
    """The step a checkpoint's trainer state names, unverified (-1 when unreadable: resume will say why)."""
    from .checkpoint import read_trainer_state

    try:
        return int(read_trainer_state(checkpoint)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
