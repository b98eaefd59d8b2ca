"""The loss in the form the hand-derived tests write it: options as plain arguments, one advantage per completion."""

from __future__ import annotations

from typing import Any

import torch

from grpo_trainer.losses import GammaShape, LossOptions, SoftGate, loss_variant, per_token_loss


def token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    policy_weight: torch.Tensor | None = None,
    sampler_weight: torch.Tensor | None = None,
    soft_gate: SoftGate = SoftGate(),  # noqa: B008 (frozen: one shared default is safe)
    gamma: GammaShape = GammaShape(),  # noqa: B008
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`losses.per_token_loss` of a built-in type with its options as plain arguments and one advantage per
    completion ([B]): the form of the hand-derived tests. The clip arguments go to the types that
    read them, `soft_gate` to sapo, `gamma` to vespo; the others are ignored, as the options are not checked here
    (the config does that)."""
    variant = loss_variant(loss_type)
    options: LossOptions
    if variant.options is SoftGate:
        options = soft_gate
    elif variant.options is GammaShape:
        options = gamma
    else:
        given: dict[str, Any] = {"epsilon_low": epsilon_low, "epsilon_high": epsilon_high, "delta": delta}
        options = variant.options.model_construct(
            **{k: v for k, v in given.items() if k in variant.options.model_fields}
        )
    return per_token_loss(
        variant,
        options,
        logp,
        old_logp,
        advantages[:, None].expand_as(logp),
        mask,
        ref_logp=ref_logp,
        beta=beta,
        policy_weight=policy_weight,
        sampler_weight=sampler_weight,
    )
