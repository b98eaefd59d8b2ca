"""Checkpoints: atomic saves under OUTPUT_DIR/checkpoints, and finding the one to resume.

Layout: `checkpoints/step-000020/` holds Accelerate's state (model, optimizer,
scheduler, every rank's RNG) plus `trainer_state.json` (counters, sampler
position). It is written as `checkpoints/.tmp-step-000020/` and renamed into
place only when complete; `checkpoints/latest` is updated last. A crash mid-save
therefore leaves the previous checkpoint intact and `latest` pointing at it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(accelerator, output_dir: str | Path, step: int, trainer_state: dict[str, Any], keep_last: int = 0) -> Path:
    """Every rank calls this (Accelerate's save is collective); the main process renames and prunes."""
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:06d}"
    staging = root / f".tmp-step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_atomic(staging / TRAINER_STATE, json.dumps({**trainer_state, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _write_atomic(root / LATEST, final.name)
        if keep_last > 0:
            for old in sorted(complete_checkpoints(output_dir))[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file())


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """`never` -> None; `auto` -> newest complete checkpoint or None; else the given path (must be complete)."""
    if resume == "never":
        return None
    if resume == "auto":
        latest = checkpoint_root(output_dir) / LATEST
        if latest.is_file():
            candidate = checkpoint_root(output_dir) / latest.read_text().strip()
            if (candidate / TRAINER_STATE).is_file():
                return candidate
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no {TRAINER_STATE})")
    return path


def load_checkpoint(accelerator, path: str | Path) -> dict[str, Any]:
    accelerator.load_state(str(path))
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
