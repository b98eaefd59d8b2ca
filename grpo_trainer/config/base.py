"""What every section shares: the strict base model and the flags that say what a change means on resume."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# What changing a field on resume means (`resume_effect`), flagged on the field or on a whole section:
# CHANGES_MEANING: the run's samples or objective would change, so resuming is refused unless
# checkpoint.force_resume; HARMLESS_ON_RESUME: only how long it runs or what it records. Unflagged: allowed, warned.
CHANGES_MEANING: dict[str, Any] = {"resume": "meaning"}
HARMLESS_ON_RESUME: dict[str, Any] = {"resume": "harmless"}


class _Section(BaseModel):
    """Strict base: unknown keys are errors, assignments are re-validated, and `true`/`false` is not a number.

    Pydantic's lax mode reads a bool as 1 or 0 where an int or float is asked (`train.max_steps=true` would run
    one step); that is refused for every number field of the tree. Strings stay readable as numbers: PyYAML reads
    `1e-4` (no dot) as a string, and `train.learning_rate: 1e-4` must mean 0.0001. NaN and infinity (`.nan`,
    `.inf`) are refused too: no number of the tree means anything at them (a NaN weight scores every sample NaN).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info) -> Any:
        if isinstance(value, bool) and _asks_a_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


def _asks_a_number(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and no bool (`int`, `float | None`, ...)."""
    kinds = set(getattr(annotation, "__args__", None) or (annotation,))
    return bool(kinds & {int, float}) and bool not in kinds and Any not in kinds


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (`LoraConfig | None` -> LoraConfig), or None for a plain value."""
    inner = getattr(annotation, "__args__", (annotation,))
    return next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
