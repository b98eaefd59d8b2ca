"""Optional loss terms (KL to the reference, the teacher's term, the entropy bonus, the rollout correction,
off-policy masking): objects of one interface (`base.LossTerm`), registered here.

A new term is a `LossTerm` subclass in its own module, one line in `TERMS`, and its keys in the config's `loss`
section (`enabled` reads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Addition, LossTerm, StepTotals, Sum, TermInputs, TermModels, shapes_advantages
from .correction import OffPolicyMask, RolloutCorrection
from .entropy import EntropyBonus
from .kl import KlToReference
from .teacher import Teacher

if TYPE_CHECKING:
    from ..config import Config

# The order the hooks run in: the advantage is shaped before the weights read it (off-policy masking reads the
# sequence advantage); the KL joins the per-token loss, the entropy bonus the share.
TERMS: tuple[type[LossTerm], ...] = (Teacher, RolloutCorrection, OffPolicyMask, KlToReference, EntropyBonus)


def term_types(cfg: Config) -> tuple[type[LossTerm], ...]:
    """The terms the config asks for, in the order they apply."""
    return tuple(kind for kind in TERMS if kind.enabled(cfg))


def build_terms(cfg: Config, models: TermModels) -> tuple[LossTerm, ...]:
    return tuple(kind.build(cfg, models) for kind in term_types(cfg))


__all__ = [
    "TERMS",
    "Addition",
    "LossTerm",
    "StepTotals",
    "Sum",
    "TermInputs",
    "TermModels",
    "build_terms",
    "shapes_advantages",
    "term_types",
]
