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
WEIGHTS = "model.safetensors"  # Accelerate's name for the first prepared model's weights (the policy)
METRICS_HISTORY = "metrics.jsonl"  # the run's metrics up to the checkpoint's step
LATEST = "latest"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    keep_last: int = 0,
    files: dict[str, str] | None = None,
) -> Path:
    """Every rank calls this (Accelerate's save is collective); the main process renames and prunes.

    `files` are extra text files written into the checkpoint (the metrics history so far).
    """
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:06d}"
    staging = root / f".tmp-step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    _pause_for_fault_injection()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, text in (files or {}).items():
            (staging / name).write_text(text)
        # trainer_state.json is what marks a checkpoint complete: written last, inside the staging folder.
        _write_atomic(staging / TRAINER_STATE, json.dumps({**trainer_state, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _write_atomic(root / LATEST, final.name)
        if keep_last > 0:
            for old in sorted(complete_checkpoints(output_dir))[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete staging folders a crash left behind (never a complete checkpoint)."""
    root = checkpoint_root(output_dir)
    stale = sorted(root.glob(".tmp-step-*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


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
        hint = f" (it holds {checkpoint / 'model'}: use that)" if (checkpoint / "model" / "config.json").is_file() else ""
        raise ConfigError(
            f"checkpoint: {checkpoint} is not a training checkpoint (no {TRAINER_STATE}) nor a save_pretrained "
            f"folder (no config.json){hint}; expected OUTPUT_DIR/model or OUTPUT_DIR/checkpoints/step-N"
        )
    if not (checkpoint / WEIGHTS).is_file():
        raise ConfigError(
            f"checkpoint: {checkpoint} has no {WEIGHTS}: a sharded FSDP/DeepSpeed checkpoint must be merged first "
            "(`accelerate merge-weights`, or DeepSpeed's zero_to_fp32.py), or use OUTPUT_DIR/model"
        )
    cfg = config_from_dict(read_trainer_state(checkpoint)["config"], source=str(checkpoint / TRAINER_STATE))
    lm = load_causal_lm(cfg.model)
    load_policy_weights(lm, checkpoint / WEIGHTS, cfg.model.name_or_path)
    return lm, load_tokenizer(cfg.model, cfg.data.chat_template), cfg


def load_checkpoint(accelerator, path: str | Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states in place; return the trainer state."""
    accelerator.load_state(str(path))
    return read_trainer_state(path)


# Settings that change what a run means: resuming with a different value is refused unless forced.
MEANING_KEYS = (
    "seed",
    "model.name_or_path",
    "model.dtype",
    "model.lora",
    "data.source",
    "data.subset",
    "data.split",
    "data.prompt_column",
    "data.answer_column",
    "data.system_prompt",
    "data.chat_template",
    "data.use_chat_template",
    "data.num_samples",
    "rollout.num_generations",
    "loss.type",
    "train.prompts_per_step",
)
# Settings that only say how long to run and what to record: changing them is harmless.
HARMLESS_PREFIXES = ("output_dir", "train.max_steps", "logging.", "checkpoint.", "eval.")


def check_resume_compatible(
    saved: dict[str, Any], current: dict[str, Any], saved_world: int | None, world: int, force: bool
) -> list[tuple[str, bool]]:
    """Compare the checkpoint's resolved config with this run's.

    Returns (note, harmless) for each allowed change, to be logged (a change that is neither
    harmless nor refused, e.g. the learning rate, deserves a warning); raises TrainingError listing
    the changes that would break the run's meaning, unless `force`.
    """
    from .errors import TrainingError

    old, new = flatten(saved), flatten(current)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    refused = [k for k in changed if k in MEANING_KEYS or any(k.startswith(m + ".") for m in MEANING_KEYS)]
    problems = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in refused]
    if saved_world is not None and saved_world != world:
        problems.append(f"number of processes: {saved_world} -> {world} (each rank's prompts and random streams would change)")
    if problems and not force:
        raise TrainingError(
            "cannot resume: these settings differ from the checkpoint's and change what the run means:\n  "
            + "\n  ".join(problems)
            + "\nstart a new output_dir, or set checkpoint.force_resume=true to resume anyway"
        )
    notes = [(f"{k}: {old.get(k)!r} -> {new.get(k)!r}", k.startswith(HARMLESS_PREFIXES)) for k in changed if k not in refused]
    return notes + [(f"(forced) {p}", False) for p in problems]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _pause_for_fault_injection() -> None:
    """Test hook: GRPO_TRAINER_PAUSE_IN_SAVE=SECONDS stalls every save between writing the state and
    publishing it, so a test can kill the process at the worst moment (tests/test_checkpoint.py)."""
    seconds = float(os.environ.get("GRPO_TRAINER_PAUSE_IN_SAVE", "0") or 0)
    if seconds > 0:
        import time

        time.sleep(seconds)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
