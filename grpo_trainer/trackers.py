"""Experiment trackers named in `logging.report_to`: tensorboard, wandb, trackio, mlflow.

They run through Accelerate's tracker classes (`Accelerator(log_with=...)`, `accelerator.log`,
`end_training`), which serve as they are for metrics and the config; this module adds what they leave to
the caller: checking at load that the package is installed (one line saying what to install), where each
one writes, and the per-step sample tables (prompt, completion, reward, advantage) for the trackers that
have tables. Only the main process writes.

Where each writes (the tracker's own environment variables win where it has them):

    tensorboard  OUTPUT_DIR/trackers/<logging.project>/<time>/events.out.tfevents.*
    wandb        OUTPUT_DIR/trackers/wandb/run-* (offline-run-* with WANDB_MODE=offline: nothing leaves the
                 machine, `wandb sync` uploads it later); the config and every metric are in its run-*.wandb file
    trackio      TRACKIO_DIR (default ~/.cache/huggingface/trackio)/<logging.project>.db, a local SQLite
                 database; `trackio show` opens the dashboard
    mlflow       MLFLOW_TRACKING_URI, or else a local file store OUTPUT_DIR/trackers/mlruns
                 (`mlflow ui --backend-store-uri OUTPUT_DIR/trackers/mlruns`); samples as JSON table artifacts

Tables: wandb (`wandb.Table`), trackio (`trackio.Table`) and mlflow (`mlflow.log_table`, one artifact per
step under samples/); tensorboard has no tables (the samples stay in completions.jsonl).

Deliberately not done: resuming the tracker's run after a checkpoint resume (each start opens a new
tracker run; the steps carry on from the checkpoint's).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config
from .errors import ConfigError

logger = logging.getLogger("grpo_trainer")

SAMPLE_COLUMNS = ["step", "prompt", "completion", "reward", "advantage"]
SAMPLE_TABLE = "samples"  # the table's name in the trackers (not `completions`: metrics under completions/ exist)


@dataclass(frozen=True)
class Tracker:
    module: str  # what must be importable
    extra: str  # the pip extra that installs it


TRACKERS = {
    "tensorboard": Tracker("tensorboard", "tensorboard"),
    "wandb": Tracker("wandb", "wandb"),
    "trackio": Tracker("trackio", "trackio"),
    "mlflow": Tracker("mlflow", "mlflow"),
}


def chosen(cfg: Config) -> list[str]:
    """The trackers `logging.report_to` names (jsonl is the trainer's own file, always written)."""
    return [name for name in cfg.logging.report_to if name in TRACKERS]


def check_installed(cfg: Config) -> None:
    """A tracker whose package is missing stops the run at load, saying what to install."""
    for name in chosen(cfg):
        tracker = TRACKERS[name]
        if importlib.util.find_spec(tracker.module) is None:
            raise ConfigError(
                f"logging.report_to: {name} needs the {tracker.module} package, which is not installed: "
                f"pip install 'grpo-trainer[{tracker.extra}]'"
            )


def trackers_dir(cfg: Config) -> Path:
    return Path(cfg.output_dir) / "trackers"


def start_trackers(accelerator, cfg: Config, hparams: dict[str, Any]) -> None:
    """Open every chosen tracker's run (named after output_dir) with the config as its parameters."""
    names = chosen(cfg)
    if not names:
        return
    run_name = Path(cfg.output_dir).resolve().name
    init_kwargs: dict[str, dict[str, Any]] = {}
    if "wandb" in names:
        if accelerator.is_main_process:
            trackers_dir(cfg).mkdir(parents=True, exist_ok=True)  # wandb writes under dir/wandb, which must exist
        init_kwargs["wandb"] = {"dir": str(trackers_dir(cfg)), "name": run_name}
    if "trackio" in names:
        init_kwargs["trackio"] = {"name": run_name, "embed": False}  # no dashboard server started from a run
    if "mlflow" in names:
        init_kwargs["mlflow"] = {"run_name": run_name}
        if accelerator.is_main_process:
            _default_mlflow_store(cfg)
    accelerator.init_trackers(cfg.logging.project, config=hparams, init_kwargs=init_kwargs)


def _default_mlflow_store(cfg: Config) -> None:
    """Without MLFLOW_TRACKING_URI, a local file store in the run's folder (MLflow's own default, ./mlflow.db,
    needs SQLAlchemy, which mlflow-skinny does not bring). MLflow 3.7+ keeps its file store in maintenance mode
    and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, which is set here for this default store only."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return
    import mlflow

    store = trackers_dir(cfg) / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(store.resolve().as_uri())


def log_samples(accelerator, samples: list[dict[str, Any]], step: int) -> None:
    """The step's sample completions as a table, in each tracker that has tables (main process)."""
    if not samples or not accelerator.is_main_process:
        return
    rows = [[sample[column] for column in SAMPLE_COLUMNS] for sample in samples]
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.log_table(SAMPLE_TABLE, columns=SAMPLE_COLUMNS, data=rows, step=step)
        elif tracker.name == "trackio":
            import trackio

            tracker.log({SAMPLE_TABLE: trackio.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            columns = {column: [row[i] for row in rows] for i, column in enumerate(SAMPLE_COLUMNS)}
            mlflow.log_table(columns, artifact_file=f"{SAMPLE_TABLE}/step_{step:06d}.json")
