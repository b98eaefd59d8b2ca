"""The teacher's term (on-policy distillation, `losses.teacher_advantage`): each token's advantage gains
teacher_kl * (log pi_teacher - log mu) of the sampled token; under `loss.teacher_only` it is the whole advantage
(the rewards are still computed and logged). Logged: `teacher/reverse_kl`, the sampled per-token reverse
KL(mu || teacher), and `teacher/advantage_share`, the teacher term's part of |A| (first pass)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from .. import losses
from .base import LossTerm, StepTotals, Sum, TermInputs, TermModels


class Teacher(LossTerm):
    name = "teacher"
    sums: ClassVar[Mapping[str, Sum]] = {"teacher_kl": Sum.FIRST, "teacher_term": Sum.FIRST, "group_term": Sum.FIRST}

    def __init__(self, teacher: Callable[..., Any], coef: float, only: bool):
        self.teacher, self.coef, self.only = teacher, coef, only

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.loss.teacher_on

    @classmethod
    def build(cls, cfg, models: TermModels) -> LossTerm:
        if models.teacher is None:
            raise ValueError("loss.teacher_kl > 0 needs the teacher")
        return cls(models.teacher, cfg.loss.teacher_kl, cfg.loss.teacher_only)

    def annotate(self, mb) -> torch.Tensor:
        return self.teacher(**mb.sequences)[0]

    def advantage(self, inputs: TermInputs) -> torch.Tensor:
        teacher_logp, behaviour, mask = inputs.mb.annotations[self.name], inputs.behaviour_logp, inputs.mask
        term = losses.teacher_advantage(teacher_logp, behaviour, mask, self.coef)
        group = torch.zeros_like(inputs.advantages) if self.only else inputs.advantages
        inputs.record(  # the sampled reverse KL, and the two terms' sizes
            teacher_kl=losses.masked_sum(behaviour - teacher_logp, mask),
            teacher_term=losses.masked_sum(term.abs(), mask),
            group_term=losses.masked_sum(group.abs(), mask),
        )
        return group + term

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        teacher, group = sums["teacher_term"], sums["group_term"]
        return {
            "teacher/reverse_kl": float(sums["teacher_kl"]) / totals.trained_tokens,
            "teacher/advantage_share": float(teacher) / max(float(teacher + group), 1e-30),
        }
