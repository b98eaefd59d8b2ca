"""Experiment trackers named in `logging.report_to`: tensorboard, wandb, trackio, mlflow.

They run through Accelerate's tracker classes (`Accelerator(log_with=...)`, `accelerator.log`,
`end_training`), which serve as they are for metrics and the config; this module adds what they leave to
the caller: checking at load that the package is installed (one line saying what to install) and that it
can start here (`check_ready`: wandb online has an API key, read as wandb reads it, without the network; an
MLflow tracking server at MLFLOW_TRACKING_URI accepts connections), so that neither fails after the model
loaded and left a partial output folder; where each one writes, and the per-step sample tables (prompt,
completion, reward, advantage) for the trackers that have tables. Only the main process writes.

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
import socket
import urllib.parse
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


def check_ready(cfg: Config) -> None:
    """A chosen tracker that cannot start here stops the run now, in one line naming `logging.report_to`."""
    names = chosen(cfg)
    if "wandb" in names and not wandb_can_log():
        raise ConfigError(
            "logging.report_to: wandb is online and finds no API key: set WANDB_API_KEY (or run `wandb login`), or "
            "set WANDB_MODE=offline to log to OUTPUT_DIR/trackers/wandb (`wandb sync` uploads it later)"
        )
    if "mlflow" in names:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        problem = unreachable(uri)
        if problem:
            raise ConfigError(
                f"logging.report_to: mlflow: the tracking server MLFLOW_TRACKING_URI={uri} cannot be reached ({problem}): "
                "start it or correct the URI, or unset MLFLOW_TRACKING_URI to log to OUTPUT_DIR/trackers/mlruns"
            )


def wandb_can_log() -> bool:
    """Whether wandb.init would find what it needs: nothing offline (WANDB_MODE offline, dryrun, disabled), else
    an API key from where wandb looks for one without the network (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, its
    settings files, the .netrc entry `wandb login` writes for its host). True where wandb's own readers cannot be
    used (another version): no false alarm."""
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth
        from wandb.sdk.wandb_settings import Settings

        settings = Settings()
        config_dir = os.environ.get("WANDB_CONFIG_DIR")
        settings.settings_system = str(Path(config_dir or "~/.config/wandb").expanduser() / "settings")
        settings.update_from_system_settings()  # also the workspace's (`wandb offline` writes mode there)
        settings.update_from_env_vars(dict(os.environ))
        if settings.mode in ("offline", "dryrun", "disabled"):
            return True
        if settings.api_key or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
            return True
        return bool(read_netrc_auth(host=settings.base_url))
    except Exception:  # noqa: BLE001  wandb's internals moved: let wandb.init say what it needs
        return True


def unreachable(uri: str, timeout: float = 5.0) -> str | None:
    """Why nothing accepts a connection at an http(s) tracking URI (None: something does, or the URI is not
    a server's: a file store, a database, Databricks). Only the connection is tried: what answers is the
    tracker's business."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return "its port is not a number from 0 to 65535"
    if not parts.hostname:
        return "it names no host"
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


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
