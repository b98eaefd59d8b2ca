"""Checkpoints: atomic, verified saves under OUTPUT_DIR/checkpoints, finding the one to resume, and what a run
saves into one and restores from it (`save_step`, `restore`: the parts of the run a checkpoint covers, `Resumable`).

Layout: `checkpoints/step-000020/` holds Accelerate's state (model, optimizer,
scheduler, every rank's RNG), `trainer_state.json` (counters, sampler position), under asynchronous
rollouts each rank's sampled, untrained batches (`rollouts_rank<r>.pkl`, rollout_queue.py),
the metrics history, and `manifest.json` (every file's size and SHA-256). It is
written as `checkpoints/.tmp-step-000020/`: files, then fsync, then the manifest
(written last), then the rename into place, then `checkpoints/latest`. So:

- a crash or SIGKILL mid-save leaves the previous checkpoint intact and `latest`
  pointing at it;
- a save that fails (full disk, quota, permissions) removes its partial folder,
  leaves `latest` alone and stops the run with one line naming the folder and
  the free space (`CheckpointError`);
- a checkpoint damaged after it was written (a truncated file, a bit flip) is
  found by `verify`: resume falls back to the newest intact one and says so;
- a manifest edited by hand counts as damage too (`manifest_problem`): one that
  is not `{"files": {...}}`, names a path outside the checkpoint, or leaves out
  a file the checkpoint holds (`{"files": {}}` would vouch for everything);
- a checkpoint without a manifest (written before checkpoints carried one) is
  used unverified, with a warning saying so (`unverified_note`).

Not covered: a file system that acknowledges an fsync it did not perform.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from .errors import TrainingError

if TYPE_CHECKING:
    from .config import Config
    from .data import PromptSampler
    from .metrics import MetricsWriter
    from .train_state import TrainState

logger = logging.getLogger("grpo_trainer")

TRAINER_STATE = "trainer_state.json"
WEIGHTS = "model.safetensors"  # Accelerate's name for the first prepared model's weights (the policy)
METRICS_HISTORY = "metrics.jsonl"  # the run's metrics up to the checkpoint's step
MANIFEST = "manifest.json"  # {"files": {relative path: {"size": bytes, "sha256": hex}}}, written last
LATEST = "latest"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(TrainingError):
    """A checkpoint could not be written, or none that could be read is intact."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    keep_last: int = 0,
    files: dict[str, str] | None = None,
    rank_files: Callable[[Path], None] | None = None,
) -> Path:
    """Every rank calls this (Accelerate's save is collective); the main process publishes and prunes.

    `files` are extra text files written into the checkpoint (the metrics history so far); `rank_files(folder)`
    writes each rank's own (the rollout queue's sampled batches). Any rank's failure stops every rank with the
    same CheckpointError, after the partial folder is removed.
    """
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:06d}"
    staging = root / f".tmp-step-{step:06d}"

    def fresh_staging() -> None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)

    error = None
    if accelerator.is_main_process:
        error = _attempt(fresh_staging)
    error = _first_error(accelerator, error)
    if error is None:
        error = _first_error(accelerator, _attempt(lambda: _save_state(accelerator, staging)))
    if error is None and rank_files is not None:
        error = _first_error(accelerator, _attempt(lambda: rank_files(staging)))
    _pause_for_fault_injection()
    if error is None and accelerator.is_main_process:
        error = _attempt(lambda: _publish(staging, final, root, {**trainer_state, "step": step}, files or {}))
        if error is None and keep_last > 0:
            for old in sorted(complete_checkpoints(output_dir))[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    error = _first_error(accelerator, error)
    if error is not None:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(_save_failed_message(staging, root, step, error))
    return final


def _save_state(accelerator, folder: Path) -> None:
    """Accelerate's save_state, with tied weights stored once without its alarm.

    A tied model (lm_head = embed_tokens, as in the tiny model) has two names for one tensor; safetensors
    stores a tensor once, so Accelerate drops the later names itself, warning "Removed shared tensor ...
    This should be OK, but check" on every save. The same names are dropped here first (the file is the
    same), quietly: loading restores the tie (safetensors' `load_model` skips names that share storage).
    """
    handle = accelerator.register_save_state_pre_hook(_drop_tied_duplicates)
    try:
        accelerator.save_state(str(folder))
    finally:
        handle.remove()


def _drop_tied_duplicates(models, weights: list[dict], folder: str) -> None:
    """Keep the first name of each tensor storage in every state dict (Accelerate's own rule, in place)."""
    from accelerate.utils import id_tensor_storage

    for state in weights:
        seen = set()
        for name in list(state):
            tensor = state[name]
            if isinstance(tensor, str):
                continue
            storage = id_tensor_storage(tensor)
            if storage in seen:
                del state[name]
            seen.add(storage)


def _publish(staging: Path, final: Path, root: Path, trainer_state: dict, files: dict[str, str]) -> None:
    for name, text in files.items():
        (staging / name).write_text(text)
    (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
    manifest: dict[str, dict[str, Any]] = {"files": {}}
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        _fsync(path)
        manifest["files"][path.relative_to(staging).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(final, ignore_errors=True)  # a damaged checkpoint of the same step, resumed from before it
    os.replace(staging, final)
    _fsync(root)
    _write_durably(root / LATEST, final.name)


def _attempt(action) -> str | None:
    """Run `action`; the failure as one line (None on success). Broad on purpose: torch.save reports a full
    disk as a RuntimeError, safetensors as its own error type."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def _first_error(accelerator, error: str | None) -> str | None:
    """The first rank's error, the same on every rank (a collective), or None when all succeeded."""
    if accelerator.num_processes == 1:
        return error
    from accelerate.utils import gather_object

    return next((e for e in gather_object([error]) if e), None)


def _save_failed_message(staging: Path, root: Path, step: int, error: str) -> str:
    try:
        free = f"{shutil.disk_usage(root if root.exists() else root.parent).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    latest = root / LATEST
    previous = latest.read_text().strip() if latest.is_file() else None
    kept = f"the previous checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
    return (
        f"checkpoint: saving step {step} to {staging} failed ({error}); {free}; {kept}. "
        "Free space (or fix permissions), then rerun with checkpoint.resume=auto"
    )


def verify(folder: str | Path) -> str | None:
    """What is wrong with a complete checkpoint's files (one line naming the file), or None when its manifest
    matches, or when it has no manifest (see `unverified_note`: such a checkpoint is used, and it is said).

    A manifest is trusted only as far as it is well formed (`manifest_problem`): it lists every file of the
    checkpoint, each by a path inside the checkpoint. A manifest edited by hand into `{"files": {}}` would
    otherwise vouch for files it never saw, and a path like `../../x` would have a file outside the checkpoint
    read and hashed. A bad manifest makes the checkpoint damaged, like a bad file: resume falls back to an
    older one.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        listed = json.loads(manifest_path.read_text())
    except (ValueError, OSError) as exc:
        return f"{manifest_path}: unreadable ({type(exc).__name__})"
    problem = manifest_problem(folder, listed)
    if problem:
        return f"{manifest_path}: {problem}"
    for name, expected in listed["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path}: {size} bytes, {expected['size']} written"
        if _sha256(path) != expected["sha256"]:
            return f"{path}: contents differ from what was written (SHA-256 mismatch)"
    return None


def manifest_problem(folder: Path, manifest: Any) -> str | None:
    """What makes `manifest` (as read from folder's manifest.json) not one `_publish` could have written, or None.

    It must be `{"files": {PATH: {"size": BYTES, "sha256": HEX}}}` (other keys are ignored), each PATH relative
    and inside `folder` (no `..`, no symbolic link leading out), and every file in the folder but the manifest
    itself listed: a file the manifest does not cover is one no check covers (Accelerate finds its files by
    name, so an unlisted one would be loaded unverified).
    """
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return 'not a checkpoint manifest (expected {"files": {path: {"size": ..., "sha256": ...}}})'
    for name, entry in files.items():
        if not _inside(folder, name):
            return f"lists {name!r}, which is not a path inside the checkpoint"
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            return f'the entry of {name!r} is not {{"size": BYTES, "sha256": 64 hex digits}} (got {entry!r:.80})'
    # Hidden files (.DS_Store, .ipynb_checkpoints/, an rsync's temporaries) are no file Accelerate loads: not damage.
    present = {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    } - {MANIFEST}
    unlisted = sorted(present - {PurePosixPath(name).as_posix() for name in files})
    if unlisted:
        return (
            f"does not list {unlisted[0]}"
            + (f" (and {len(unlisted) - 1} more files)" if len(unlisted) > 1 else "")
            + ", which the checkpoint holds (a manifest lists every file)"
        )
    return None


def _inside(folder: Path, name: str) -> bool:
    """Whether `name` is a relative path that stays inside `folder`, symbolic links followed."""
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        return False
    try:
        return (folder / relative).resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError):  # a NUL in the name, a link loop
        return False


def unverified_note(folder: str | Path) -> str | None:
    """The line to log when a checkpoint has no manifest to verify it by, else None. Such a checkpoint (written
    before checkpoints carried a manifest, or copied without it) is used as it is, damage undetected: refusing
    it would strand runs whose checkpoints are fine."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return None
    return f"checkpoint {folder} has no {MANIFEST}: its files are used unverified (no size or SHA-256 check)"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest is 3.11+
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Write to a temporary name, fsync, rename over `path`, fsync the folder: all or nothing, on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete staging folders a crash left behind (never a complete checkpoint)."""
    root = checkpoint_root(output_dir)
    stale = sorted(root.glob(".tmp-step-*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def remove_checkpoints(output_dir: str | Path) -> None:
    """Delete every checkpoint of `output_dir` and its `latest` pointer (a run that starts over: resume=never).
    `latest` goes first, so a crash part-way leaves no pointer to a half-deleted folder."""
    root = checkpoint_root(output_dir)
    (root / LATEST).unlink(missing_ok=True)
    for path in sorted(root.glob("step-*")) + sorted(root.glob(".tmp-step-*")) if root.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file())


def require_complete(resume: str) -> Path:
    """`checkpoint.resume: PATH` as a complete checkpoint folder, or a CheckpointError saying what it is instead."""
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.resume: {path} does not exist (use auto, never, or OUTPUT_DIR/checkpoints/step-N)"
        )
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(
            f"checkpoint.resume: {path} is not a complete checkpoint (no {TRAINER_STATE}); "
            "use auto, never, or OUTPUT_DIR/checkpoints/step-N"
        )
    return path


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, and notes to log about damaged ones passed over.

    `never` -> None; `auto` -> the newest intact checkpoint (`latest` first), None when there is none at all;
    a path -> that checkpoint, which must be complete and intact. Raises CheckpointError when checkpoints
    exist but none is intact, naming the damaged file of each.
    """
    if resume == "never":
        return None, []
    if resume != "auto":
        path = require_complete(resume)
        problem = verify(path)
        if problem:
            raise CheckpointError(f"checkpoint.resume: {path} is damaged: {problem}; resume from another checkpoint")
        return path, [note for note in [unverified_note(path)] if note]
    candidates = _auto_candidates(output_dir)
    notes: list[str] = []
    for candidate in candidates:
        problem = verify(candidate)
        if problem is None:
            return candidate, notes + [note for note in [unverified_note(candidate)] if note]
        notes.append(f"checkpoint {candidate.name} is damaged ({problem}); trying an older one")
    if candidates:
        raise CheckpointError(
            f"no intact checkpoint in {checkpoint_root(output_dir)}: "
            + "; ".join(notes)
            + ". Start over with checkpoint.resume=never (or a new output_dir)"
        )
    return None, notes


def _auto_candidates(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints `resume: auto` tries, in its order: the one `latest` names, then newest first."""
    candidates = sorted(complete_checkpoints(output_dir), reverse=True)
    latest = checkpoint_root(output_dir) / LATEST
    if latest.is_file():
        pointed = checkpoint_root(output_dir) / latest.read_text().strip()
        if pointed in candidates:
            candidates.remove(pointed)
            candidates.insert(0, pointed)
    return candidates


def keep_recorded_correction(cfg: Config, is_main_process: bool = True) -> Config:
    """`cfg` with the rollout correction (`loss.tis_cap`) that the checkpoint a resume continues recorded, where
    `cfg` leaves it at `auto`: a run keeps the correction it trained with. A checkpoint of a version before `auto`
    recorded `null` (off) on every engine, and a later default may differ again; a config that sets tis_cap
    itself is a change like any other (warned about by `check_resume_compatible`). A config saved without the key
    (a version before the correction existed) trained without one.

    Called before the run is built (its loss terms are fixed then), so it reads the checkpoint `resume` names, or
    the first that `auto` tries, without verifying it (`restore` does, and falls back to an older checkpoint of
    the same run, which recorded the same value unless a resume set it)."""
    from .config import config_from_dict

    loss, resume = cfg.loss, cfg.checkpoint.resume
    if not loss.tis_cap_by_default or resume == "never":
        return cfg
    candidates = _auto_candidates(cfg.output_dir) if resume == "auto" else [Path(resume)]
    if not candidates or not (candidates[0] / TRAINER_STATE).is_file():
        return cfg  # nothing to resume (or not a checkpoint: `restore` says so)
    try:
        saved = read_trainer_state(candidates[0]).get("config", {}).get("loss", {})
    except (OSError, ValueError, AttributeError):
        return cfg  # unreadable: `restore` reports it
    recorded = saved.get("tis_cap") if isinstance(saved, dict) else None
    if isinstance(recorded, bool) or not (recorded is None or isinstance(recorded, (int, float))):
        return cfg  # `auto` written by hand into a checkpoint, or no number: what auto means here
    if recorded == loss.tis_cap:
        return cfg
    if is_main_process:
        logger.warning(
            "resuming with loss.tis_cap %s as checkpoint %s recorded (the default `auto` is %s on rollout.engine "
            "%s): set loss.tis_cap to change it",
            "null (no rollout correction)" if recorded is None else f"{recorded:g}",
            candidates[0].name,
            "null" if loss.tis_cap is None else f"{loss.tis_cap:g}",
            cfg.rollout.engine,
        )
    data = cfg.dump_unresolved()
    data["loss"]["tis_cap"] = recorded
    return config_from_dict(data, source=f"the config with {candidates[0].name}'s loss.tis_cap")


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def load_checkpoint_model(checkpoint: str | Path):
    """(causal LM with the checkpoint's weights, tokenizer, config) from a training checkpoint folder.

    The one loader of training checkpoints (`eval --checkpoint` and `export` both use it). The model,
    LoRA settings and chat template come from the resolved config the checkpoint carries, so a
    checkpoint always loads as it was trained, whatever config is at hand.
    """
    from .config import config_from_dict
    from .errors import ConfigError
    from .models import load_causal_lm, load_policy_weights, load_tokenizer

    checkpoint = Path(checkpoint)
    if not (checkpoint / TRAINER_STATE).is_file():
        hint = (
            f" (it holds {checkpoint / 'model'}: use that)" if (checkpoint / "model" / "config.json").is_file() else ""
        )
        raise ConfigError(
            f"checkpoint: {checkpoint} is not a training checkpoint (no {TRAINER_STATE}) nor a save_pretrained "
            f"folder (no config.json){hint}; expected OUTPUT_DIR/model or OUTPUT_DIR/checkpoints/step-N"
        )
    if not (checkpoint / WEIGHTS).is_file():
        raise ConfigError(
            f"checkpoint: {checkpoint} has no {WEIGHTS}: a sharded FSDP/DeepSpeed checkpoint must be merged first "
            "(`accelerate merge-weights`, or DeepSpeed's zero_to_fp32.py), or use OUTPUT_DIR/model"
        )
    problem = verify(checkpoint)
    if problem:
        raise CheckpointError(f"checkpoint: {checkpoint} is damaged: {problem}")
    if unverified_note(checkpoint):
        logger.warning("%s", unverified_note(checkpoint))
    cfg = config_from_dict(read_trainer_state(checkpoint)["config"], source=str(checkpoint / TRAINER_STATE))
    lm = load_causal_lm(cfg.model)
    load_policy_weights(lm, checkpoint / WEIGHTS, cfg.model.name_or_path)
    return lm, load_tokenizer(cfg.model, cfg.data.chat_template), cfg


def load_checkpoint(accelerator, path: str | Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return the trainer state."""
    accelerator.load_state(str(path))
    return read_trainer_state(path)


def check_resume_compatible(
    saved: dict[str, Any], current: dict[str, Any], saved_world: int | None, world: int, force: bool
) -> list[tuple[str, bool]]:
    """Compare the checkpoint's resolved config (`resolved_today`'s, for a checkpoint of an earlier version) with
    this run's.

    Returns (note, harmless) for each allowed change, to be logged (a change that is neither
    harmless nor refused, e.g. the learning rate, deserves a warning); raises TrainingError listing
    the changes that would break the run's meaning, unless `force`.
    """
    from .config import resume_effect  # the schema flags what a change means (config.CHANGES_MEANING)

    old, new = flatten(saved), flatten(current)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    refused = [k for k in changed if resume_effect(k) == "meaning"]
    problems = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in refused]
    if saved_world is not None and saved_world != world:
        problems.append(
            f"number of processes: {saved_world} -> {world} (each rank's prompts and random streams would change)"
        )
    if problems and not force:
        raise TrainingError(
            "cannot resume: these settings differ from the checkpoint's and change what the run means:\n  "
            + "\n  ".join(problems)
            + "\nstart a new output_dir, or set checkpoint.force_resume=true to resume anyway"
        )
    notes = [
        (f"{k}: {old.get(k)!r} -> {new.get(k)!r}", resume_effect(k) == "harmless") for k in changed if k not in refused
    ]
    return notes + [(f"(forced) {p}", False) for p in problems]


def resolved_today(saved: dict[str, Any], *, absolute_paths: bool = False) -> dict[str, Any]:
    """A checkpoint's config as this version resolves it (an older version's keys, e.g. the flat loss options,
    read into today's places; with `absolute_paths`, its local paths made absolute as a run's are), so that only
    real changes are reported; as saved where it no longer loads."""
    from .config import config_from_dict, with_absolute_paths
    from .errors import UserError

    try:
        config = config_from_dict(saved, source="the checkpoint's config")
        # An earlier run saved its local paths as written: compared as a run resolves them now (trainer.train).
        return (with_absolute_paths(config) if absolute_paths else config).model_dump(mode="json")
    except (UserError, ValueError, TypeError):
        return saved


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


class QueuePositions(Protocol):
    """The rollout queue as a checkpoint sees it (rollout_queue.RolloutQueue, which imports this module): the
    prompts drawn and not trained yet, and each rank's completions of them."""

    @property
    def pending(self) -> Sized: ...

    def state_dict(self) -> dict: ...

    def settle_for_checkpoint(self) -> list[int]: ...

    def save_rollouts(self, folder: Path) -> None: ...

    def load_state_dict(self, state: dict, step: int, folder: Path | None = None) -> None: ...


@dataclass(frozen=True)
class Resumable:
    """The parts of a run a checkpoint saves beside the `TrainState` and a resume loads back into: Accelerate's
    prepared objects and RNGs (through `accelerator`), the prompt sampler's and the rollout queue's positions,
    the metrics history; and what the resume checks compare (the config, the number of processes)."""

    cfg: Config
    accelerator: Any
    world: int
    sampler: PromptSampler
    rollouts: QueuePositions
    metrics: MetricsWriter

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)


def restore(parts: Resumable) -> tuple[TrainState, dict[str, str] | None]:
    """The state to continue from, with the decode kernel choices its checkpoint recorded: the checkpoint's that
    `find_resume_checkpoint` picks (its model, optimizer, sampler and queue positions and metrics history loaded
    into `parts`), or a fresh one (no choices recorded; under resume=never an earlier run's checkpoints removed)."""
    from .cpu import paths as cpu_paths
    from .train_state import TrainState

    cfg, accelerator = parts.cfg, parts.accelerator
    found, damaged = find_resume_checkpoint(cfg.output_dir, cfg.checkpoint.resume)
    for note in damaged if accelerator.is_main_process else []:
        logger.warning("%s", note)
    if found is not None:
        saved = read_trainer_state(found)
        for note, harmless in check_resume_compatible(
            resolved_today(saved.get("config", {}), absolute_paths=True),
            cfg.model_dump(mode="json"),
            saved.get("world_size"),
            parts.world,
            cfg.checkpoint.force_resume,
        ):
            (logger.info if harmless else logger.warning)("changed on resume: %s", note)
        load_checkpoint(accelerator, found)
        state = TrainState.restored(saved, cfg.loss.entropy_coef, adaptive_entropy=cfg.loss.entropy_target is not None)
        parts.sampler.load_state_dict(saved["sampler"])
        # Saved completions are each rank's share: another number of processes (checkpoint.force_resume) samples again.
        same_ranks = saved.get("world_size") == parts.world
        parts.rollouts.load_state_dict(saved.get("rollout_queue", {}), state.step, found if same_ranks else None)
        parts.metrics.restore((found / METRICS_HISTORY).read_text())
        cpu_paths.compare(saved.get("cpu_paths"))  # a warning for each CPU fast path that runs differently now
        logger.info("resumed from %s at step %d", found, state.step)
        return state, saved.get("decode_kernels")
    earlier = complete_checkpoints(parts.output_dir) if accelerator.is_main_process else []
    if earlier and cfg.checkpoint.resume == "never":
        # Removed, not overwritten one by one: the earlier run's steps would stay interleaved with this one's
        # (its step-5 beside our step-10), and a resume=auto after a crash would take its newest.
        logger.warning(
            "starting over in %s (checkpoint.resume=never): removing the earlier run's %d checkpoint(s) (%s) "
            "and its metrics",
            parts.output_dir,
            len(earlier),
            ", ".join(c.name for c in earlier) if len(earlier) <= 3 else f"{earlier[0].name} ... {earlier[-1].name}",
        )
        remove_checkpoints(parts.output_dir)
    elif earlier:
        logger.warning(
            "starting over in %s (checkpoint.resume=%s): its metrics and checkpoints will be overwritten",
            parts.output_dir,
            cfg.checkpoint.resume,
        )
    state = TrainState.fresh(cfg.loss.entropy_coef)
    parts.metrics.restore("")
    return state, None


def save_step(parts: Resumable, state: TrainState, history: str) -> None:
    """Every rank calls this (the save is collective) after `state.step`; `history` is the metrics file as of it.
    One record: the state, the sampler's and the queue's positions, what the resume checks compare."""
    from .cpu import paths as cpu_paths

    trainer_state = {
        **state.saved(),
        "sampler": parts.sampler.state_dict(),
        "world_size": parts.world,
        "config": parts.cfg.model_dump(mode="json"),
        "cpu_paths": cpu_paths.in_use(),
    }
    rank_files = None
    if parts.rollouts.pending:  # asynchronous rollouts: the batches drawn and not trained yet (rollout_queue.py)
        sampled = parts.rollouts.settle_for_checkpoint()  # a collective: the steps whose completions it holds
        trainer_state["rollout_queue"] = {**parts.rollouts.state_dict(), "sampled": sampled}
        rank_files = parts.rollouts.save_rollouts if sampled else None
    save_checkpoint(
        parts.accelerator,
        parts.output_dir,
        state.step,
        trainer_state,
        parts.cfg.checkpoint.keep_last,
        files={METRICS_HISTORY: history},
        rank_files=rank_files,
    )


def _pause_for_fault_injection() -> None:
    """Test hook: GRPO_TRAINER_PAUSE_IN_SAVE=SECONDS stalls every save between writing the state and
    publishing it, so a test can kill the process at the worst moment (tests/test_checkpoint.py)."""
    seconds = float(os.environ.get("GRPO_TRAINER_PAUSE_IN_SAVE", "0") or 0)
    if seconds > 0:
        import time

        time.sleep(seconds)
