"""Evaluation on held-out prompts (`eval:`)."""

from __future__ import annotations

from pydantic import Field

from .base import _Section


class EvalConfig(_Section):
    every: int = Field(
        0,
        ge=0,
        description="Evaluate every N training steps, logged as eval/... (0: never during training). "
        "Every rank evaluates the same prompts; the main process logs.",
    )
    num_samples: int | None = Field(
        None, gt=0, description="Evaluate on the first N prompts of the eval split (None: all)."
    )
    num_generations: int = Field(4, ge=1, description="k: samples per prompt for mean@k and pass@k.")
    temperature: float | None = Field(
        None, gt=0, description="Sampling temperature for evaluation (None: rollout.temperature)."
    )
