"""`TrainState`: what a training step changes and a checkpoint saves, apart from the components that do the work.

The components (accelerator, models, optimizer, engine, task, writers: `run.Run`) are built once and never
reassigned. What one step hands the next is this small frozen record: each phase that changes a part of it
returns a new value (`update` the non-finite streak and the entropy coefficient, `check_scored` the unscored
streak, the loop the step), so a step's effect on the run is visible in its signature, and a checkpoint is
`TrainState.saved()` plus the positions the sampler and the rollout queue keep themselves (their own state, as the
optimizer keeps its moments: `checkpoint.save_step` writes them all as one record).

The key names of `saved()` are the checkpoint format: checkpoints written before this class existed resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .losses import EntropyControl


@dataclass(frozen=True)
class TrainState:
    step: int = 0  # the last step done (0: none yet)
    nonfinite_in_a_row: int = 0  # optimizer steps skipped in a row for a NaN/inf loss or gradient (update.py)
    unscored_in_a_row: int = 0  # steps in a row in which no reward scored any completion (update.check_scored)
    entropy_control: EntropyControl = EntropyControl(
        0.0
    )  # the entropy term's coefficient (loss.entropy_target adapts it)
    # The decode loop's kernel choices ("decision/shape" -> alternative), fixed before the run samples anything: with
    # the config and seed they name the run's samples (rollout/kernels.py).
    decode_kernels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def fresh(cls, entropy_coef: float) -> TrainState:
        """A run's state before its first step (`loss.entropy_coef` is where the coefficient starts)."""
        return cls(entropy_control=EntropyControl(entropy_coef))

    def saved(self) -> dict[str, Any]:
        """The checkpoint's trainer-state entries for this record (the step is written by checkpoint.py)."""
        return {
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "unscored_in_a_row": self.unscored_in_a_row,
            "entropy_control": asdict(self.entropy_control),
            "decode_kernels": dict(self.decode_kernels),
        }

    @classmethod
    def restored(cls, saved: Mapping[str, Any], entropy_coef: float, adaptive_entropy: bool) -> TrainState:
        """The state a checkpoint's trainer state records (missing entries: written by an earlier version, which
        did not count them). The entropy coefficient is the checkpoint's only where it adapts; a fixed one is the
        config's (`loss.entropy_coef`, which a resume may change). Decode kernels are settled afterwards
        (`checkpoint.restore` returns `saved["decode_kernels"]`, which `run.resume` hands the engine)."""
        control = EntropyControl(entropy_coef)
        if adaptive_entropy and "entropy_control" in saved:
            control = EntropyControl(**saved["entropy_control"])
        return cls(
            step=int(saved["step"]),
            nonfinite_in_a_row=int(saved.get("nonfinite_in_a_row", 0)),
            unscored_in_a_row=int(saved.get("unscored_in_a_row", 0)),
            entropy_control=control,
        )
