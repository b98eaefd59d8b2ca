"""KL to the reference: `beta * k3` per token, added to the per-token loss (so the loss type aggregates it), never
weighted by the rollout correction or a policy weight (a correction for who sampled the tokens says nothing about
how far the policy may drift from the reference; TRL weights the same way). Logged: `kl`, k3's token mean."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from .. import losses
from .base import Addition, LossTerm, StepTotals, Sum, TermInputs, TermModels


class KlToReference(LossTerm):
    name = "kl"
    sums: ClassVar[Mapping[str, Sum]] = {"kl": Sum.PASS}

    def __init__(self, reference: Callable[..., Any], beta: float):
        self.reference, self.beta = reference, beta

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.loss.kl_on

    @classmethod
    def build(cls, cfg, models: TermModels) -> LossTerm:
        if models.reference is None:
            raise ValueError("loss.beta > 0 needs a reference scorer")
        return cls(models.reference, cfg.loss.beta)

    def annotate(self, mb) -> torch.Tensor:
        return self.reference(**mb.sequences)[0]

    def add(self, inputs: TermInputs) -> Addition:
        kl = losses.kl_k3(inputs.logp, inputs.mb.annotations[self.name])
        inputs.record(kl=losses.masked_sum(kl, inputs.mask).detach())
        return Addition(token_loss=self.beta * kl)

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        return {"kl": float(sums["kl"]) / max(totals.tokens, 1)}
