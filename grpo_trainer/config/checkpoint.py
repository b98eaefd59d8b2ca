"""Saving and resuming (`checkpoint:`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import _Section


class CheckpointConfig(_Section):
    save_every: int = Field(0, ge=0, description="Save a checkpoint every N steps (0: only at the end).")
    resume: str = Field(
        "auto", description="`auto` (newest complete checkpoint in output_dir, if any), `never`, or a checkpoint path."
    )
    keep_last: int = Field(0, ge=0, description="Keep only the newest N checkpoints (0: keep all).")
    force_resume: bool = Field(
        False, description="Resume even if settings that change the run's meaning differ from the checkpoint's."
    )
    save_final_model: bool = Field(
        True, description="Write the trained model with save_pretrained to OUTPUT_DIR/model."
    )
    save_on_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        description="Signals that stop the run at the end of the current step with a checkpoint, exit code 75 "
        "(preemption: SLURM, Kubernetes). Empty: signals act as usual.",
    )

    @field_validator("save_on_signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        import signal

        for name in names:
            if not isinstance(getattr(signal, name, None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"{name!r} is not a signal that can be caught (e.g. SIGTERM, SIGUSR1, SIGINT)")
        return names
