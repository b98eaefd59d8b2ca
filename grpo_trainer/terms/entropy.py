"""The entropy bonus: the loss becomes L - c * H, H the mean token entropy over the tokens the term acts on in a
mini-batch (all micro-batches and ranks; `losses.entropy_share`), c from the state's `entropy_control`, fixed for
the step and adapted after it under loss.entropy_target (`losses.EntropyControl`). Logged: entropy_coef,
policy_loss (the loss without -c * H) and entropy/term_mean (what entropy_target is compared with)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import torch

from .. import losses
from .base import Addition, LossTerm, StepTotals, Sum, TermInputs, TermModels


class EntropyBonus(LossTerm):
    name = "entropy"
    sums: ClassVar[Mapping[str, Sum]] = {"entropy_term": Sum.SHARE, "term_entropy": Sum.FIRST, "term_tokens": Sum.FIRST}
    needs_entropy_grad = True

    def __init__(self, target: float | None, delta: float, low: float, high: float, coef: float = math.nan, tokens=()):
        self.target, self.delta, self.low, self.high = target, delta, low, high
        self.coef = coef  # this step's (set by `for_step`)
        self.tokens: tuple[float, ...] = tuple(tokens)  # per mini-batch: the tokens H averages over, all ranks

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.loss.entropy_term

    @classmethod
    def build(cls, cfg, models: TermModels) -> LossTerm:
        loss = cfg.loss
        return cls(loss.entropy_target, loss.entropy_coef_delta, loss.entropy_coef_min, loss.entropy_coef_max)

    @staticmethod
    def mask(mb) -> torch.Tensor:
        """The tokens the term acts on: the trained ones, or the top-entropy ones that carry policy gradient under
        top_entropy_quantile (the same set as the policy term, as TRL does)."""
        return mb.mask if mb.entropy_mask is None else mb.mask * mb.entropy_mask

    def for_step(self, batch, comm, state) -> LossTerm:
        """The coefficient the state gives this step, and each mini-batch's token count over all ranks (H's
        denominator, so the micro-batches' shares add up to H whatever the split): a collective."""
        local = torch.zeros(len(batch.window_sizes), dtype=torch.float64)
        for mb in batch.micro_batches:
            local[mb.mini_batch] += float(self.mask(mb).sum())
        tokens = [float(t) for t in comm.sum(local)]
        return EntropyBonus(self.target, self.delta, self.low, self.high, state.entropy_control.applied, tokens)

    def add(self, inputs: TermInputs) -> Addition:
        if inputs.entropy is None:
            raise ValueError("the entropy term needs the policy's entropies")
        mask = self.mask(inputs.mb)
        bonus = self.coef * losses.entropy_share(inputs.entropy, mask, self.tokens[inputs.mb.mini_batch])
        detached = inputs.entropy.detach()
        inputs.record(entropy_term=bonus.detach(), term_entropy=(detached * mask).sum(), term_tokens=mask.sum())
        return Addition(share=-bonus)

    def after_step(self, sums: Mapping[str, torch.Tensor], comm, state):
        """Adaptive control (loss.entropy_target): the next step's coefficient from this step's mean entropy over
        the term's tokens, all ranks (first pass: the sampling-time policy when mini_batches = 1)."""
        if self.target is None:
            return state
        measured = comm.sum(torch.stack([sums["term_entropy"], sums["term_tokens"]]).double())
        entropy, tokens = float(measured[0]), float(measured[1])
        mean = entropy / tokens if tokens > 0 else math.nan
        control = state.entropy_control.after_step(
            mean, target=self.target, delta=self.delta, low=self.low, high=self.high
        )
        return replace(state, entropy_control=control)

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        return {
            "entropy_coef": self.coef,
            "policy_loss": float(totals.loss) + float(sums["entropy_term"]),  # the loss without -c * H
            "entropy/term_mean": float(sums["term_entropy"]) / max(float(sums["term_tokens"]), 1),
        }
