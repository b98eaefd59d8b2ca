"""Metrics and console output (`logging:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import _Section

TrackerName = Literal["jsonl", "tensorboard", "wandb", "trackio", "mlflow"]


class LoggingConfig(_Section):
    log_every: int = Field(1, gt=0, description="Write metrics every N steps.")
    report_to: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["jsonl"]),
        description="Metric sinks: `jsonl` (OUTPUT_DIR/metrics.jsonl, always on), `tensorboard`, `wandb`, `trackio`, "
        "`mlflow` (main process only; each tracker is an extra, e.g. `pip install 'grpo-trainer[wandb]'`; where each "
        "writes: docs/python_api.md#trackers). Sample tables (logging.completions_every) go to wandb, trackio and mlflow.",
    )
    project: str = Field(
        "grpo-trainer", description="Project (wandb, trackio) or experiment (mlflow) name given to the trackers."
    )
    completions_every: int = Field(
        0, ge=0, description="Every N steps, append sample completions to OUTPUT_DIR/completions.jsonl (0: never)."
    )
    num_completions: int = Field(
        4, gt=0, description="Completions recorded each time (from the main process's groups)."
    )
    print_completions: bool = Field(False, description="Also print those completions as a table on the console.")
    progress_bar: bool = Field(True, description="Show a live progress bar on the main process.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Console log level.")
