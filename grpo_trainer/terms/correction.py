"""What corrects for the sampler: the rollout correction (truncated or masked importance sampling against the
sampler's log-probs, `losses.importance_weight`) and off-policy sequence masking (DeepSeek-V3.2,
`losses.off_policy_sequence_mask`). Both weight the policy term only; neither acts where the advantage is 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from .. import losses
from .base import LossTerm, StepTotals, Sum, TermInputs, TermModels


class RolloutCorrection(LossTerm):
    """loss.tis_cap: pi_old / pi_sampler per token (or per completion), capped or masked, on the batches whose
    engine reports sampler log-probs. Logged there: the fraction of trained tokens it touched (capped, or zeroed),
    sampling/is_truncated_fraction or sampling/is_masked_fraction, and of trained completions with at least one
    such token, sampling/is_truncated_sequence_fraction or sampling/is_masked_sequence_fraction (in `sequence_*`
    modes a completion is touched whole, so the two agree up to its length)."""

    name = "rollout_correction"
    sums: ClassVar[Mapping[str, Sum]] = {"is_capped": Sum.FIRST, "is_capped_sequences": Sum.FIRST}
    acts_at_zero_advantage = False
    weights_sampler = True

    def __init__(self, cap: float, mode: str, floor: float | None):
        self.cap, self.mode, self.floor = cap, mode, floor

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.loss.correction_on

    @classmethod
    def build(cls, cfg, models: TermModels) -> LossTerm:
        cap = cfg.loss.correction_cap
        assert cap is not None  # enabled
        return cls(cap, cfg.loss.tis_mode, cfg.loss.tis_min)

    def weight(self, inputs: TermInputs) -> torch.Tensor | None:
        sampling = inputs.mb.sampling_logp
        if sampling is None:
            return None
        weight, capped = losses.importance_weight(
            inputs.old_logp, sampling, inputs.mask, self.cap, self.mode, floor=self.floor
        )
        inputs.record(
            is_capped=losses.masked_sum(capped.float(), inputs.mask),
            is_capped_sequences=capped.any(dim=1).float().sum(),  # [B] -> 0-d; `capped` is 0 off the mask
        )
        return weight

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        if not totals.sampler_logprobs:
            return {}
        kind = "masked" if self.mode.endswith("mask") else "truncated"
        return {
            f"sampling/is_{kind}_fraction": float(sums["is_capped"]) / totals.trained_tokens,
            f"sampling/is_{kind}_sequence_fraction": float(sums["is_capped_sequences"])
            / max(totals.trained_completions, 1),
        }


class OffPolicyMask(LossTerm):
    """loss.off_policy_mask_threshold: a completion with A < 0 that drifted too far from its sampler carries no
    policy gradient. Logged: sampling/off_policy_masked_fraction, of the trained completions."""

    name = "off_policy_mask"
    sums: ClassVar[Mapping[str, Sum]] = {"off_policy_masked": Sum.FIRST}
    acts_at_zero_advantage = False

    def __init__(self, threshold: float):
        self.threshold = threshold

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.loss.off_policy_mask_threshold is not None

    @classmethod
    def build(cls, cfg, models: TermModels) -> LossTerm:
        return cls(cfg.loss.off_policy_mask_threshold)

    def weight(self, inputs: TermInputs) -> torch.Tensor:
        mask = inputs.mask
        keep = losses.off_policy_sequence_mask(
            inputs.logp, inputs.behaviour_logp, inputs.sequence_advantages, mask, self.threshold
        )  # [B, 1]
        inputs.record(off_policy_masked=((1 - keep[:, 0]) * (mask.sum(1) > 0)).sum())  # real completions only
        return keep

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        fraction = float(sums["off_policy_masked"]) / max(totals.trained_completions, 1)
        return {"sampling/off_policy_masked_fraction": fraction}
