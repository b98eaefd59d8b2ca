"""The GRPO loss family as pure functions of tensors.

Shapes: B completions in a micro-batch, T completion tokens (padded);
`mask` [B, T] is 1 on real completion tokens. Log-probs are per token, fp32.

Two steps, kept apart because that is where the variants differ:
1. `token_loss`: the per-token surrogate (ratio, clipping or its soft/gamma
   replacements, optional KL).
2. `aggregate`: how token losses become one number. This is where the length
   bias lives, and it is fed totals over the *whole generation batch* (all
   micro-batches, all ranks), so splitting a batch differently does not change
   the loss (except `bnpo`, which is defined per micro-batch).
Beside them, the entropy term: `entropy_share` (the bonus, normalised like the
policy term's totals) and `EntropyControl` (its coefficient, fixed or adapted
to a target entropy; the one piece of loss state that lives across steps).

Deliberately not here: no config objects, no model calls, no distributed code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class LossVariant:
    """What distinguishes one `loss.type` from another; the config, the trainer and the docs read this table.

    ratio:        `token` (one ratio per token), `sequence` (GSPO, LUSPO: one per completion, the geometric mean
                  of its token ratios) or `sequence_product` (VESPO: one per completion, the product).
    surrogate:    `clipped` (PPO's -min(r*A, clip(r)*A)), `cispo` (-sg(clip(r, max)) * A * log pi),
                  `soft_gate` (SAPO: -f(r) * A, a sigmoid gate instead of the clip) or
                  `gamma` (VESPO: -sg(phi(W)) * A * log pi, a gamma-shaped weight of the sequence ratio W).
    aggregation:  how token losses become the batch loss (see `aggregate`).
    per_micro_batch: the loss is normalised within each micro-batch, so it depends on how the batch is cut.
    exact_zero_advantage_skip: with beta = 0 and no entropy term, leaving zero-advantage completions out of the
                  passes leaves the update unchanged (false where the normaliser counts the tokens present in a
                  micro-batch).
    options:      the `loss.*` keys its surrogate reads; setting another variant's key for it is a config error.
    """

    name: str
    ratio: Literal["token", "sequence", "sequence_product"]
    surrogate: Literal["clipped", "cispo", "soft_gate", "gamma"]
    aggregation: Literal["sequence_mean", "micro_batch_token_mean", "max_length", "batch_token_mean", "sequence_sum"]
    per_micro_batch: bool
    exact_zero_advantage_skip: bool
    paper: str
    options: tuple[str, ...]


CLIP_OPTIONS = ("epsilon_low", "epsilon_high", "delta")
SAPO_OPTIONS = ("sapo_temperature_pos", "sapo_temperature_neg")
VESPO_OPTIONS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")

LOSS_VARIANTS: dict[str, LossVariant] = {
    v.name: v
    for v in (
        LossVariant("grpo", "token", "clipped", "sequence_mean", False, True,
                    "Shao et al. 2024, DeepSeekMath, eq. 3", CLIP_OPTIONS),
        LossVariant("bnpo", "token", "clipped", "micro_batch_token_mean", True, False,
                    "Xiao et al. 2025, BNPO", CLIP_OPTIONS),
        LossVariant("dr_grpo", "token", "clipped", "max_length", False, True,
                    "Liu et al. 2025, Dr. GRPO, eq. 7", CLIP_OPTIONS),
        LossVariant("dapo", "token", "clipped", "batch_token_mean", False, True,
                    "Yu et al. 2025, DAPO, eq. 12", CLIP_OPTIONS),
        LossVariant("gspo", "sequence", "clipped", "sequence_mean", False, True,
                    "Zheng et al. 2025, GSPO, eq. 7", CLIP_OPTIONS),
        LossVariant("cispo", "token", "cispo", "batch_token_mean", False, True,
                    "MiniMax 2025, MiniMax-M1, eq. 4", ("epsilon_high",)),
        LossVariant("sapo", "token", "soft_gate", "sequence_mean", False, True,
                    "Gao et al. 2025, SAPO (Qwen), arXiv 2511.20347", SAPO_OPTIONS),
        LossVariant("luspo", "sequence", "clipped", "sequence_sum", False, True,
                    "Liu et al. 2026, LUSPO, arXiv 2602.05261", CLIP_OPTIONS),
        LossVariant("vespo", "sequence_product", "gamma", "batch_token_mean", False, True,
                    "Shen et al. 2026, VESPO, arXiv 2602.10693, sec. 3.4", VESPO_OPTIONS),
    )
}
LOSS_TYPES = tuple(LOSS_VARIANTS)


def loss_variant(loss_type: str) -> LossVariant:
    try:
        return LOSS_VARIANTS[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}") from None


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token: exp(d) - d - 1 with d = ref - logp.

    Unbiased and always >= 0 (J. Schulman, "Approximating KL Divergence", 2020); used by GRPO (Shao et al. 2024, eq. 4).
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass(frozen=True)
class SoftGate:
    """SAPO's gate temperatures (Gao et al. 2025, arXiv 2511.20347): tau for tokens of completions with A > 0,
    and for the rest. The paper (and TRL, verl) default to 1.0 and 1.05: a negative update raises the logits of
    every unsampled token, so it is let to decay faster as the ratio drifts."""

    temperature_pos: float = 1.0
    temperature_neg: float = 1.05


@dataclass(frozen=True)
class GammaShape:
    """VESPO's kernel phi(W) = W^k exp(lambda (1 - W)) parameters by the sign of A (Shen et al. 2026, sec. 3.4,
    where k and lambda are c1 and c2). The defaults are the authors' released code and run scripts (and TRL's):
    A >= 0: k = 2, lambda = 3; A < 0: k = 3, lambda = 2."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0


# VESPO's log W is kept in [ln 1e-8, 20], as in the authors' code: phi stays finite at any drift (a sampler
# correction of 0, i.e. a masked token, gives W ~ 1e-8 and phi ~ 0 instead of log 0).
VESPO_LOG_W_RANGE = (math.log(1e-8), 20.0)
# Each token's log ratio is clamped to this range before the sum that forms ln W, as the authors' code and TRL's
# get_gamma_weights do: a token beyond +-20 counts as +-20, so log ratios +25 and -24.5 give W = 1, not e^0.5.
VESPO_TOKEN_LOG_RATIO_RANGE = (-20.0, 20.0)


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
    soft_gate: SoftGate = SoftGate(),
    gamma: GammaShape = GammaShape(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (padding included; `aggregate` masks it) and clipping counts.

    advantages: [B], one per completion. `policy_weight` [B, T] (detached), when given, multiplies the
    policy term only, not the KL term (e.g. top-entropy token selection). `sampler_weight` [B, T] (detached)
    is the rollout correction pi_old / pi_sampler (`importance_weight`): it multiplies the policy term too,
    except for VESPO, whose sequence ratio W absorbs it (W = pi_theta / pi_sampler over the completion, as the
    paper and TRL do). A correction for who sampled the tokens says nothing about how far the policy may drift
    from the reference, so the KL term is never weighted (TRL weights the same way). Returned metrics are
    *sums over real tokens* (`clip_low`, `clip_high`, `clip_region`, and `kl` when beta > 0) so that callers
    can add them across micro-batches and ranks, then divide by the token count. SAPO and VESPO clip nothing:
    their clip counts are 0.
    """
    variant = loss_variant(loss_type)
    adv = advantages[:, None]  # [B, 1]
    log_ratio = logp - old_logp  # [B, T]

    if variant.surrogate == "cispo":
        loss, clip_low, clip_high = _cispo(logp, log_ratio, adv, epsilon_high)
    elif variant.surrogate == "soft_gate":
        loss, clip_low, clip_high = _soft_gate(log_ratio, adv, soft_gate)
    elif variant.surrogate == "gamma":
        loss, clip_low, clip_high = _gamma(logp, log_ratio, advantages, mask, gamma, sampler_weight)
        sampler_weight = None  # inside W already
    else:
        loss, clip_low, clip_high = _clipped(
            logp, log_ratio, adv, mask, variant.ratio, epsilon_low, epsilon_high, delta
        )
    if sampler_weight is not None:
        loss = loss * sampler_weight
    if policy_weight is not None:
        loss = loss * policy_weight

    metrics = {
        "clip_low": masked_sum(clip_low.float(), mask).detach(),
        "clip_high": masked_sum(clip_high.float(), mask).detach(),
        "clip_region": masked_sum((clip_low | clip_high).float(), mask).detach(),
    }
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_k3(logp, ref_logp)
        loss = loss + beta * kl
        metrics["kl"] = masked_sum(kl, mask).detach()
    return loss, metrics


def _clipped(logp, log_ratio, adv, mask, ratio_kind, epsilon_low, epsilon_high, delta):
    """PPO's clipped surrogate on a token ratio (GRPO, BNPO, Dr. GRPO, DAPO) or a sequence ratio (GSPO, LUSPO)."""
    if ratio_kind == "sequence":
        # GSPO (Zheng et al. 2025, eq. 7): s_i = exp(mean_t(log pi_theta - log pi_old)), one ratio per sequence.
        lengths = mask.sum(1).clamp(min=1)
        seq_log_ratio = masked_sum(log_ratio, mask, dim=1) / lengths  # [B]
        ratio = torch.exp(seq_log_ratio)[:, None].expand_as(logp)  # [B, T], constant along each sequence
    else:
        ratio = torch.exp(log_ratio)
    # PPO clipped surrogate (Schulman et al. 2017, eq. 7) with DAPO's decoupled clip-higher range
    # (Yu et al. 2025, eq. 10): -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A).
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv
    loss = -torch.min(unclipped, clipped)
    clip_low = (ratio < 1 - epsilon_low) & (adv < 0)
    clip_high = (ratio > 1 + epsilon_high) & (adv > 0)
    if delta is not None:
        # Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for A < 0 the
        # loss is bounded by -delta*A, so one huge ratio cannot blow up the update.
        loss = torch.where(adv < 0, torch.min(loss, -delta * adv), loss)
    return loss, clip_low, clip_high


def _cispo(logp, log_ratio, adv, epsilon_high):
    # MiniMax-M1 (2025), eq. 4: -sg(clip(r, max=1+eps_high)) * A * log pi_theta.
    # The weight is detached, so every token keeps a gradient: none is dropped by clipping.
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1 + epsilon_high).detach()
    loss = -weight * adv * logp
    clip_low = torch.zeros_like(ratio, dtype=torch.bool)
    clip_high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, clip_low, clip_high


def _soft_gate(log_ratio, adv, gate: SoftGate):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): -f(r) A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, per token,
    tau by the sign of A (tau_pos for A > 0, tau_neg otherwise). Its slope f'(r) = 4 s (1 - s), with
    s = sigmoid(tau (r - 1)), is 1 at r = 1, so on-policy the gradient is GRPO's, -A grad log pi; away from r = 1
    it decays smoothly instead of dropping to 0 at a clip boundary, and a few off-policy tokens do not silence
    their sequence."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, adv.new_tensor(gate.temperature_pos), adv.new_tensor(gate.temperature_neg))  # [B, 1]
    loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    nothing = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, nothing, nothing


def _gamma(logp, log_ratio, advantages, mask, shape: GammaShape, sampler_weight):
    """VESPO (Shen et al. 2026, sec. 3.4): -sg(phi(W_i)) A_i log pi_theta(o_t) per token, with W_i = prod_t r_t the
    completion's own importance ratio (a product: no length normalisation; times prod_t of the sampler correction
    when given, so W = pi_theta / pi_sampler) and phi(W) = W^k exp(lambda (1 - W)), a gamma-shaped kernel that is
    1 at W = 1 and falls off on both sides, more steeply the larger k and lambda. The gradient is
    phi(W) A grad log pi: REINFORCE with a smooth, per-sequence weight, nothing clipped. phi is computed in log
    space, k ln W + lambda (1 - W), from ln W kept in VESPO_LOG_W_RANGE, summed from token log ratios each kept in
    VESPO_TOKEN_LOG_RATIO_RANGE and sampler corrections each kept in VESPO_LOG_W_RANGE (the authors' code and
    TRL's get_gamma_weights clamp at both levels)."""
    log_w = masked_sum(log_ratio.detach().clamp(*VESPO_TOKEN_LOG_RATIO_RANGE), mask, dim=1)  # [B]
    if sampler_weight is not None:
        log_w = log_w + masked_sum(torch.log(sampler_weight).clamp(*VESPO_LOG_W_RANGE), mask, dim=1)
    log_w = log_w.detach().clamp(*VESPO_LOG_W_RANGE)
    positive = advantages >= 0  # the authors' code and TRL: A = 0 takes the positive branch (its loss is 0 anyway)
    k = torch.where(positive, advantages.new_tensor(shape.k_pos), advantages.new_tensor(shape.k_neg))
    lam = torch.where(positive, advantages.new_tensor(shape.lambda_pos), advantages.new_tensor(shape.lambda_neg))
    phi = torch.exp(k * log_w + lam * (1 - torch.exp(log_w)))  # [B], detached
    loss = -phi[:, None] * advantages[:, None] * logp
    nothing = torch.zeros_like(logp, dtype=torch.bool)
    return loss, nothing, nothing


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    total_sequences: int,
    total_tokens: int | float,
    max_completion_length: int,
    total_micro_batches: int,
) -> torch.Tensor:
    """This micro-batch's share of the generation-batch loss.

    Summing the shares over all micro-batches on all ranks gives the loss of the
    whole batch; `total_*` are counts over that whole batch (all ranks).
      sequence_mean (grpo, gspo, sapo): mean over sequences of each sequence's token mean (Shao et al. 2024, eq. 3)
      micro_batch_token_mean (bnpo): token mean within the micro-batch, then mean over micro-batches (Xiao et al. 2025)
      max_length (dr_grpo): token sum / (sequences x max_completion_length) (Liu et al. 2025, Dr. GRPO, eq. 7)
      batch_token_mean (dapo, cispo, vespo): token sum / tokens of the whole batch (Yu et al. 2025, DAPO, eq. 12;
                                      MiniMax-M1 eq. 4; VESPO as its authors' code and TRL run it)
      sequence_sum (luspo): token sum / sequences, i.e. each sequence's loss weighted by its length
                            (Liu et al. 2026, LUSPO: GSPO's per-sequence mean times |o_i|)
    """
    aggregation = loss_variant(loss_type).aggregation
    if aggregation == "sequence_mean":
        per_sequence = masked_sum(loss, mask, dim=1) / mask.sum(1).clamp(min=1)
        return per_sequence.sum() / total_sequences
    if aggregation == "micro_batch_token_mean":
        return masked_sum(loss, mask) / mask.sum().clamp(min=1) / total_micro_batches
    if aggregation == "max_length":
        return masked_sum(loss, mask) / (total_sequences * max_completion_length)
    if aggregation == "sequence_sum":
        return masked_sum(loss, mask) / total_sequences
    return masked_sum(loss, mask) / max(total_tokens, 1)  # batch_token_mean


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weight(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, cap: float, mode: str = "token_truncate",
    floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout correction for a sampler (e.g. vLLM) that scores tokens slightly differently from the trainer, or
    sampled them with older weights (asynchronous rollouts, docs/async.md): per-token weight [B, T] (detached) for
    `token_loss`'s `sampler_weight`, and which real tokens fell outside [floor, cap] [B, T] (bool).

    The ratio is pi_old / pi_sampler per token (`token_*`), or its product over the completion's tokens,
    exp(sum_t log pi_old - log pi_sampler), shared by every token of it (`sequence_*`). `*_truncate` caps it,
    min(ratio, cap) (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"); `*_mask` drops what goes over the cap, ratio if ratio <= cap else 0
    (masked importance sampling, as TRL's `vllm_importance_sampling_mode`). Masking discards a token (or a
    completion) whose sampler probability is far off instead of keeping it at weight `cap`.

    `floor` bounds the ratio from below as well (TRL's `vllm_importance_sampling_clip_min`): clamped up to it
    (`*_truncate`), or zeroed below it (`*_mask`). `token_mask` with [floor, cap] is IcePop (Ling Team 2025,
    Ring-1T, "IcePop: token-level discrepancy masking"): M(k) = k if k in [alpha, beta] else 0, with
    k = pi_train(theta_old) / pi_infer(theta_old); alpha 0.5, beta 5 there.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {IS_MODES}")
    log_ratio = old_logp - sampling_logp  # [B, T]
    if mode.startswith("sequence"):
        log_ratio = masked_sum(log_ratio, mask, dim=1)[:, None].expand_as(old_logp)  # log of the product over tokens
    ratio = torch.exp(log_ratio)
    outside = ratio > cap if floor is None else (ratio > cap) | (ratio < floor)
    if mode.endswith("truncate"):
        weight = ratio.clamp(min=floor, max=cap)
    else:
        weight = torch.where(outside, torch.zeros_like(ratio), ratio)
    return weight.detach(), outside & (mask > 0)


def off_policy_sequence_mask(
    logp: torch.Tensor, sampling_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-AI 2025, DeepSeek-V3.2 technical report, "Off-Policy Sequence
    Masking"): [B, 1] (detached), 0 for a completion that both hurt (A_i < 0) and has drifted far from the policy
    that sampled it, 1 otherwise:

        M_i = 0  if  A_i < 0  and  (1/|o_i|) sum_t log(pi_sampler(o_i,t) / pi_theta(o_i,t)) > threshold

    pi_sampler is the sampler's own log-probs (the inference engine's, possibly K weight versions old), pi_theta
    the policy being trained, without gradient. Why only negative advantages (the report's reasoning): a policy
    learns most from its own mistakes, while a negative sample that is far off-policy can mislead or destabilise
    the update. TRL's `off_policy_mask_threshold`, the same rule.
    `mask` [B, T] marks the tokens that count (a row of zeros is never masked)."""
    drift = masked_sum(sampling_logp - logp.detach(), mask, dim=1) / mask.sum(1).clamp(min=1)  # [B] mean log-ratio
    drop = (advantages < 0) & (drift > threshold)
    return (~drop).to(logp.dtype)[:, None]


def entropy_threshold(entropies: torch.Tensor, rho: float) -> float:
    """The (1 - rho) quantile of token entropies (linear interpolation between order statistics, as
    torch.quantile, without its input-size limit): tokens at or above it are the top-rho highest-entropy
    "forking" tokens that alone carry policy gradient (Wang et al. 2025, "Beyond the 80/20 Rule:
    High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning", sec. 5). rho = 0 keeps only the
    maximum; no tokens at all gives +inf (nothing is kept, and nothing had a gradient to keep)."""
    values = entropies.flatten().double().sort().values
    n = values.numel()
    if n == 0:
        return math.inf
    position = (1 - rho) * (n - 1)
    low = int(math.floor(position))
    high = min(low + 1, n - 1)
    return float(values[low] + (position - low) * (values[high] - values[low]))


# ----------------------------------------------------------------------------- the entropy term


def entropy_share(entropy: torch.Tensor, mask: torch.Tensor, total_tokens: int | float) -> torch.Tensor:
    """This micro-batch's share of H, the mean token entropy over the tokens the entropy term acts on in its
    mini-batch (`total_tokens` of them, all micro-batches and ranks): sum_t H_t m_t / total_tokens.

    The loss becomes L_policy - c * H (the entropy bonus of PPO, Schulman et al. 2017, eq. 9; Skywork-OR1's
    entropy loss, He et al. 2025). H is a token mean whatever the loss type, so c means the same for all of
    them (as TRL's `entropy_coef`), and the shares add up to H over any split into micro-batches and ranks.
    `entropy` [B, T] must carry its gradient (models.TokenLogprobs with entropy_grad=True).
    """
    return masked_sum(entropy, mask) / max(total_tokens, 1)


@dataclass(frozen=True)
class EntropyControl:
    """The entropy term's coefficient from one step to the next: the only loss state a checkpoint must carry.

    Fixed (`loss.entropy_target` unset): `coef` every step. Adaptive (Skywork-OR1's adaptive entropy control,
    He et al. 2025, arXiv 2505.22312; their `EntController`): after each step, whose mean token entropy was e,
    coef <- clip(coef + delta if e < target else coef - delta, low, high), and the term applies in the next step
    only if e < target (`active`): it pushes entropy back up when it falls below the target and is switched
    off while entropy is above it. It starts active with the configured coefficient, as their code does.
    """

    coef: float
    active: bool = True

    @property
    def applied(self) -> float:
        """The coefficient this step's loss uses."""
        return self.coef if self.active else 0.0

    def after_step(self, entropy: float, *, target: float, delta: float, low: float, high: float) -> EntropyControl:
        """The state for the next step, given this step's mean token entropy (NaN: nothing measured, unchanged)."""
        if math.isnan(entropy):
            return self
        below = entropy < target
        return EntropyControl(min(max(self.coef + (delta if below else -delta), low), high), below)
