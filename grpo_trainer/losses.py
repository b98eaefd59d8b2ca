"""The GRPO loss family as pure functions of tensors, and the registry of loss types.

Shapes: B completions in a micro-batch, T completion tokens (padded);
`mask` [B, T] is 1 on real completion tokens. Log-probs are per token, fp32.

Two steps, kept apart because that is where the variants differ:
1. `per_token_loss`: the loss type's surrogate (ratio, clipping or its soft/gamma
   replacements) on per-token advantages [B, T], then what every type shares
   (rollout-correction and policy weights, the optional KL term).
2. `aggregate`: how token losses become one number. This is where the length
   bias lives, and it is fed totals over the *whole generation batch* (all
   micro-batches, all ranks), so splitting a batch differently does not change
   the loss (except `bnpo`, which is defined per micro-batch).
Beside them, the entropy term: `entropy_share` (the bonus, normalised like the
policy term's totals) and `EntropyControl` (its coefficient, fixed or adapted
to a target entropy; the one piece of loss state that lives across steps).

The registry, `LOSS_VARIANTS`: one `LossVariant` per `loss.type` with its surrogate, its aggregation, its
options (a pydantic model of their own, `loss.options`), its paper and its docs row. The config, the trainer,
the config reference, the model card and docs/loss_family.md all read it, so a new loss type is one entry
here (plus its tests and docs); a user's own is a `LossVariant` named by import path
(`loss.type: my_losses.py:MY_LOSS`, resolved like rewards) or added with `register_loss`.

Deliberately not here: no config objects (the options models are plain pydantic models the config embeds),
no model calls, no distributed code. The aggregations are a closed set (each is a normaliser the trainer
feeds totals for); a new loss type picks one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

Aggregation = Literal["sequence_mean", "micro_batch_token_mean", "max_length", "batch_token_mean", "sequence_sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token: exp(d) - d - 1 with d = ref - logp.

    Unbiased and always >= 0 (J. Schulman, "Approximating KL Divergence", 2020); used by GRPO (Shao et al. 2024, eq. 4).
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


# ----------------------------------------------------------------------------- options: one model per loss type


class LossOptions(BaseModel):
    """A loss type's own options (`loss.options`), checked by its own model: an unknown key is an error (the
    config names the loss type that reads it), values are frozen once validated. A type without options uses
    this model as it is; a user's type subclasses it (register_loss and loss_variant refuse other models)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # as config._Section


class ClipOptions(LossOptions):
    """PPO's clip range with DAPO's clip-higher (Yu et al. 2025, eq. 10) and the dual clip (Ye et al. 2020, eq. 5)."""

    epsilon_low: float = Field(0.2, ge=0, description="Lower clip range: ratios below 1 - epsilon_low are clipped.")
    epsilon_high: float | None = Field(
        None, ge=0, description="Upper clip range (DAPO clip-higher); None means equal to epsilon_low."
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="Dual-clip bound for negative advantages: the token loss is at most -delta*A (None: off).",
    )

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @model_validator(mode="after")
    def _delta_outside_the_clip(self) -> ClipOptions:
        if self.delta is not None and self.delta <= 1 + self.epsilon_high_value:
            raise ValueError(
                f"delta ({self.delta}) must be larger than 1 + epsilon_high ({1 + self.epsilon_high_value}), "
                "or the dual clip would cut into the clip range"
            )
        return self


class CispoOptions(LossOptions):
    """CISPO clips only the (detached) weight from above."""

    epsilon_high: float = Field(0.2, ge=0, description="The weight is sg(min(r, 1 + epsilon_high)).")


class SoftGate(LossOptions):
    """SAPO's gate temperatures (Gao et al. 2025, arXiv 2511.20347): tau for tokens of completions with A > 0,
    and for the rest. The paper (and TRL, verl) default to 1.0 and 1.05: a negative update raises the logits of
    every unsampled token, so it is let to decay faster as the ratio drifts."""

    temperature_pos: float = Field(
        1.0,
        gt=0,
        description="Temperature tau of the soft gate sigmoid(tau (r - 1)) * 4 / tau for tokens with "
        "advantage > 0 (larger: the gradient decays faster as the ratio leaves 1).",
    )
    temperature_neg: float = Field(
        1.05, gt=0, description="The gate temperature for advantage <= 0; the paper keeps it above the positive one."
    )


class GammaShape(LossOptions):
    """VESPO's kernel phi(W) = W^k exp(lambda (1 - W)) parameters by the sign of A (Shen et al. 2026, sec. 3.4,
    where k and lambda are c1 and c2). The defaults are the authors' released code and run scripts (and TRL's):
    A >= 0: k = 2, lambda = 3; A < 0: k = 3, lambda = 2."""

    k_pos: float = Field(
        2.0,
        ge=0,
        description="Power k of the weight phi(W) = W^k exp(lambda (1 - W)) of the sequence ratio W, for "
        "advantage >= 0 (c1 in the paper).",
    )
    lambda_pos: float = Field(3.0, ge=0, description="Decay lambda of phi(W) for advantage >= 0 (c2 in the paper).")
    k_neg: float = Field(3.0, ge=0, description="Power k of phi(W) for advantage < 0.")
    lambda_neg: float = Field(2.0, ge=0, description="Decay lambda of phi(W) for advantage < 0.")


# ----------------------------------------------------------------------------- what a surrogate sees


@dataclass(frozen=True)
class TokenInputs:
    """What a surrogate reads, all [B, T]: `logp` (with its gradient), `old_logp` (the ratio's denominator),
    `advantages` per token (a completion's A repeated along it, plus any per-token term a caller adds, so such a
    term needs no per-loss code), `mask` and `sampler_weight` (the rollout correction pi_old / pi_sampler, or
    None), which only a type with `sampler_weight_in_ratio` reads: for the others the caller applies it."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    sampler_weight: torch.Tensor | None = None

    @property
    def log_ratio(self) -> torch.Tensor:
        return self.logp - self.old_logp


# A surrogate: (inputs, options) -> (per-token loss [B, T], clipped-below [B, T] bool, clipped-above [B, T] bool).
# Its options are its variant's own model (`LossVariant.options`, a LossOptions subclass), which a Callable type
# cannot tie to the variant: hence Any.
Surrogate = Callable[[TokenInputs, Any], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class LossVariant:
    """One `loss.type`: everything the config, the trainer and the docs need to know about it.

    surrogate:    (TokenInputs, options) -> (per-token loss, clip_low, clip_high); `per_token_loss` adds the
                  weights and the KL term every type shares.
    aggregation:  how token losses become the batch loss (see `aggregate`).
    options:      the model of its `loss.options` (validated by it; `LossOptions`: none).
    exact_zero_advantage_skip: with beta = 0 and no entropy term, leaving zero-advantage completions out of the
                  passes leaves the update unchanged (true only when the surrogate is 0 at A = 0 and the
                  normaliser does not count the tokens present in a micro-batch).
    sampler_weight_in_ratio: the surrogate folds the rollout correction into its own ratio (VESPO's W) instead
                  of being multiplied by it; such a type takes only a per-token correction (`tis_mode token_*`).
    ratio:        `token`, `sequence` (GSPO, LUSPO: the geometric mean of the token ratios) or `sequence_product`
                  (VESPO); for the docs and the tests' tolerances.
    title:        the name a reader knows it by ("Dr. GRPO"), as pyproject's description and the README list it.
    formula, use: the docs row (docs/loss_family.md): the per-token loss, and when to choose it.
    legacy_keys:  flat `loss.*` keys of earlier versions read as its options (`sapo_temperature_pos` ->
                  `temperature_pos`), so older configs and configs saved in checkpoints keep loading.
    """

    name: str
    surrogate: Surrogate
    aggregation: Aggregation
    options: type[LossOptions] = LossOptions
    paper: str = ""
    exact_zero_advantage_skip: bool = False
    sampler_weight_in_ratio: bool = False
    ratio: Literal["token", "sequence", "sequence_product"] = "token"
    title: str = ""
    formula: str = ""
    use: str = ""
    legacy_keys: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.title:
            object.__setattr__(self, "title", self.name)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"loss type {self.name!r}: unknown aggregation {self.aggregation!r}; one of {AGGREGATIONS}"
            )
        unknown = set(self.legacy_keys.values()) - set(self.options.model_fields)
        if unknown:
            raise ValueError(f"loss type {self.name!r}: legacy_keys name options its model lacks: {sorted(unknown)}")

    @property
    def per_micro_batch(self) -> bool:
        """The loss is normalised within each micro-batch, so it depends on how the batch is cut."""
        return self.aggregation == "micro_batch_token_mean"

    def __call__(self, inputs: TokenInputs, options: LossOptions):
        """The surrogate (a variant is callable so that `file.py:NAME` resolves it like a reward function)."""
        return self.surrogate(inputs, options)


# VESPO's log W is kept in [ln 1e-8, 20], as in the authors' code: phi stays finite at any drift (a sampler
# correction of 0, i.e. a masked token, gives W ~ 1e-8 and phi ~ 0 instead of log 0).
VESPO_LOG_W_RANGE = (math.log(1e-8), 20.0)
# Each token's log ratio is clamped to this range before the sum that forms ln W, as the authors' code and TRL's
# get_gamma_weights do: a token beyond +-20 counts as +-20, so log ratios +25 and -24.5 give W = 1, not e^0.5.
VESPO_TOKEN_LOG_RATIO_RANGE = (-20.0, 20.0)


def per_token_loss(
    variant: LossVariant,
    options: LossOptions,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    policy_weight: torch.Tensor | None = None,
    sampler_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (padding included; `aggregate` masks it) and clipping counts.

    advantages: [B, T], per token (a completion's A along it, plus whatever per-token term the caller adds).
    `policy_weight` [B, T] (detached), when given, multiplies the policy term only, not the KL term (e.g.
    top-entropy token selection). `sampler_weight` [B, T] (detached) is the rollout correction pi_old /
    pi_sampler (`importance_weight`): it multiplies the policy term too, except for a type with
    `sampler_weight_in_ratio` (VESPO), whose ratio absorbs it (W = pi_theta / pi_sampler over the completion,
    as the paper and TRL do). A correction for who sampled the tokens says nothing about how far the policy may
    drift from the reference, so the KL term is never weighted (TRL weights the same way). Returned metrics are
    *sums over real tokens* (`clip_low`, `clip_high`, `clip_region`, and `kl` when beta > 0) so that callers
    can add them across micro-batches and ranks, then divide by the token count. SAPO and VESPO clip nothing:
    their clip counts are 0.
    """
    inputs = TokenInputs(logp, old_logp, advantages, mask, sampler_weight if variant.sampler_weight_in_ratio else None)
    loss, clip_low, clip_high = variant.surrogate(inputs, options)
    if sampler_weight is not None and not variant.sampler_weight_in_ratio:
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


def clipped_token_ratio(inputs: TokenInputs, options: ClipOptions):
    """PPO's clipped surrogate on each token's ratio (GRPO, BNPO, Dr. GRPO, DAPO)."""
    return _clipped(inputs, options, torch.exp(inputs.log_ratio))


def clipped_sequence_ratio(inputs: TokenInputs, options: ClipOptions):
    """PPO's clipped surrogate on one ratio per completion (GSPO, LUSPO; Zheng et al. 2025, eq. 7):
    s_i = exp(mean_t(log pi_theta - log pi_old)), the same for every token of the completion."""
    lengths = inputs.mask.sum(1).clamp(min=1)
    seq_log_ratio = masked_sum(inputs.log_ratio, inputs.mask, dim=1) / lengths  # [B]
    return _clipped(inputs, options, torch.exp(seq_log_ratio)[:, None].expand_as(inputs.logp))


def _clipped(inputs: TokenInputs, options: ClipOptions, ratio: torch.Tensor):
    adv, epsilon_low, epsilon_high = inputs.advantages, options.epsilon_low, options.epsilon_high_value
    # PPO clipped surrogate (Schulman et al. 2017, eq. 7) with DAPO's decoupled clip-higher range
    # (Yu et al. 2025, eq. 10): -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A).
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv
    loss = -torch.min(unclipped, clipped)
    clip_low = (ratio < 1 - epsilon_low) & (adv < 0)
    clip_high = (ratio > 1 + epsilon_high) & (adv > 0)
    if options.delta is not None:
        # Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for A < 0 the
        # loss is bounded by -delta*A, so one huge ratio cannot blow up the update.
        loss = torch.where(adv < 0, torch.min(loss, -options.delta * adv), loss)
    return loss, clip_low, clip_high


def cispo(inputs: TokenInputs, options: CispoOptions):
    """MiniMax-M1 (2025), eq. 4: -sg(clip(r, max=1+eps_high)) * A * log pi_theta.
    The weight is detached, so every token keeps a gradient: none is dropped by clipping."""
    adv = inputs.advantages
    ratio = torch.exp(inputs.log_ratio)
    weight = ratio.clamp(max=1 + options.epsilon_high).detach()
    loss = -weight * adv * inputs.logp
    clip_low = torch.zeros_like(ratio, dtype=torch.bool)
    clip_high = (ratio > 1 + options.epsilon_high) & (adv > 0)
    return loss, clip_low, clip_high


def soft_gate(inputs: TokenInputs, gate: SoftGate):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): -f(r) A with f(r) = sigmoid(tau (r - 1)) * 4 / tau, per token,
    tau by the sign of A (tau_pos for A > 0, tau_neg otherwise). Its slope f'(r) = 4 s (1 - s), with
    s = sigmoid(tau (r - 1)), is 1 at r = 1, so on-policy the gradient is GRPO's, -A grad log pi; away from r = 1
    it decays smoothly instead of dropping to 0 at a clip boundary, and a few off-policy tokens do not silence
    their sequence."""
    adv = inputs.advantages
    ratio = torch.exp(inputs.log_ratio)
    tau = torch.where(adv > 0, adv.new_tensor(gate.temperature_pos), adv.new_tensor(gate.temperature_neg))  # [B, T]
    loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    nothing = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, nothing, nothing


def gamma(inputs: TokenInputs, shape: GammaShape):
    """VESPO's surrogate (`_gamma`), the sampler correction folded into W."""
    return _gamma(inputs.logp, inputs.log_ratio, inputs.advantages, inputs.mask, shape, inputs.sampler_weight)


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
    # advantages are per token [B, T]: phi for either sign of A over the completions [B] (detached), then each
    # token's by the sign of its A (the authors' code and TRL: A = 0 takes the positive branch; its loss is 0 anyway).
    phi_pos, phi_neg = (
        torch.exp(
            log_w.new_full(log_w.shape, k, dtype=advantages.dtype) * log_w
            + log_w.new_full(log_w.shape, lam, dtype=advantages.dtype) * (1 - torch.exp(log_w))
        )
        for k, lam in ((shape.k_pos, shape.lambda_pos), (shape.k_neg, shape.lambda_neg))
    )
    phi = torch.where(advantages >= 0, phi_pos[:, None], phi_neg[:, None])  # [B, T]
    loss = -phi * advantages * logp
    nothing = torch.zeros_like(logp, dtype=torch.bool)
    return loss, nothing, nothing


# ----------------------------------------------------------------------------- the registry

LOSS_VARIANTS: dict[str, LossVariant] = {}


def register_loss(variant: LossVariant) -> LossVariant:
    """Add a loss type under its name, so that `loss.type: NAME` selects it (a user's type can also be named by
    import path without registering). A name is taken once: a second, different entry is an error."""
    if not isinstance(variant, LossVariant):
        raise TypeError(f"register_loss takes a LossVariant, got {type(variant).__name__}")
    if ":" in variant.name or not variant.name:
        raise ValueError(f"loss type name {variant.name!r}: a plain name (':' marks an import path)")
    existing = LOSS_VARIANTS.get(variant.name)
    if existing is not None and existing is not variant:
        raise ValueError(f"loss type {variant.name!r} is already registered")
    if not issubclass(variant.options, LossOptions):
        raise TypeError(f"loss type {variant.name!r}: options must subclass losses.LossOptions")
    LOSS_VARIANTS[variant.name] = variant
    return variant


_CLIP_KEYS = {"epsilon_low": "epsilon_low", "epsilon_high": "epsilon_high", "delta": "delta"}
_AS_GRPO = "as `grpo`"

for _variant in (
    LossVariant(
        "grpo",
        clipped_token_ratio,
        "sequence_mean",
        ClipOptions,
        "Shao et al. 2024, DeepSeekMath, eq. 3",
        exact_zero_advantage_skip=True,
        title="GRPO",
        legacy_keys=_CLIP_KEYS,
        formula="-min(r_t A_t, clip(r_t) A_t)",
        use="you want the reference GRPO behaviour; note it makes right answers short and wrong answers long (below)",
    ),
    LossVariant(
        "bnpo",
        clipped_token_ratio,
        "micro_batch_token_mean",
        ClipOptions,
        "Xiao et al. 2025, BNPO",
        title="BNPO",
        legacy_keys=_CLIP_KEYS,
        formula=_AS_GRPO,
        use="reproducing TRL's `bnpo`; the loss depends on how the batch is cut into micro-batches (by definition)",
    ),
    LossVariant(
        "dr_grpo",
        clipped_token_ratio,
        "max_length",
        ClipOptions,
        "Liu et al. 2025, Dr. GRPO, eq. 7",
        exact_zero_advantage_skip=True,
        title="Dr. GRPO",
        legacy_keys=_CLIP_KEYS,
        formula=_AS_GRPO,
        use="removing the length bias; pair with `scale_rewards: none`; raise the learning rate (the loss is divided "
        "by L_max, not by lengths)",
    ),
    LossVariant(
        "dapo",
        clipped_token_ratio,
        "batch_token_mean",
        ClipOptions,
        "Yu et al. 2025, DAPO, eq. 12",
        exact_zero_advantage_skip=True,
        title="DAPO",
        legacy_keys=_CLIP_KEYS,
        formula=_AS_GRPO,
        use="long reasoning: every token weighs the same, so long completions are not diluted; pair with clip-higher",
    ),
    LossVariant(
        "gspo",
        clipped_sequence_ratio,
        "sequence_mean",
        ClipOptions,
        "Zheng et al. 2025, GSPO, eq. 7",
        exact_zero_advantage_skip=True,
        ratio="sequence",
        title="GSPO",
        legacy_keys=_CLIP_KEYS,
        formula="-min(s_i A_t, clip(s_i) A_t), one ratio per completion s_i = exp(mean_t log r_t)",
        use="MoE models or noisy per-token ratios; use a narrow clip range (3e-4 / 4e-4)",
    ),
    LossVariant(
        "cispo",
        cispo,
        "batch_token_mean",
        CispoOptions,
        "MiniMax 2025, MiniMax-M1, eq. 4",
        exact_zero_advantage_skip=True,
        title="CISPO",
        legacy_keys={"epsilon_high": "epsilon_high"},
        formula="-sg(min(r_t, 1 + epsilon_high)) A_t log pi_theta(o_t)",
        use="many updates per batch (`num_iterations` > 1): the weight is clipped but no token loses its gradient",
    ),
    LossVariant(
        "sapo",
        soft_gate,
        "sequence_mean",
        SoftGate,
        "Gao et al. 2025, SAPO (Qwen), arXiv 2511.20347",
        exact_zero_advantage_skip=True,
        title="SAPO",
        legacy_keys={"sapo_temperature_pos": "temperature_pos", "sapo_temperature_neg": "temperature_neg"},
        formula="-f(r_t) A_t, f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = `temperature_pos` if A_t > 0 else "
        "`temperature_neg`",
        use="off-policy updates (batch reuse, MoE routing noise) where a hard clip silences tokens or, in GSPO, whole "
        "sequences: the gate fades each token's gradient smoothly; on-policy it is GRPO",
    ),
    LossVariant(
        "luspo",
        clipped_sequence_ratio,
        "sequence_sum",
        ClipOptions,
        "Liu et al. 2026, LUSPO, arXiv 2602.05261",
        exact_zero_advantage_skip=True,
        ratio="sequence",
        title="LUSPO",
        legacy_keys=_CLIP_KEYS,
        formula="as `gspo`",
        use="GSPO's sequence ratio without GSPO's length bias (its responses shrink as training goes on); GSPO-like "
        "narrow clip, 2e-3 / 2.5e-3",
    ),
    LossVariant(
        "vespo",
        gamma,
        "batch_token_mean",
        GammaShape,
        "Shen et al. 2026, VESPO, arXiv 2602.10693, sec. 3.4",
        exact_zero_advantage_skip=True,
        sampler_weight_in_ratio=True,
        ratio="sequence_product",
        title="VESPO",
        legacy_keys={
            "vespo_k_pos": "k_pos",
            "vespo_lambda_pos": "lambda_pos",
            "vespo_k_neg": "k_neg",
            "vespo_lambda_neg": "lambda_neg",
        },
        formula="-sg(phi(W_i)) A_t log pi_theta(o_t), W_i = prod_t r_t, phi(W) = W^k e^(lambda (1 - W)), "
        "(k, lambda) by the sign of A_t",
        use="stale batches (many mini-batches, asynchronous rollouts) and sampler mismatch: a smooth sequence-level "
        "importance weight, no clip, no length normalisation",
    ),
):
    register_loss(_variant)
LOSS_TYPES = tuple(LOSS_VARIANTS)  # the built-in types (register_loss adds to LOSS_VARIANTS, not to this)

# What each aggregation means, in the words of docs/loss_family.md's table (N completions, T real tokens in the
# whole generation batch, L_max = rollout.max_completion_length).
AGGREGATION_DOCS = {
    "sequence_mean": "mean over each completion's tokens, then mean over the N completions",
    "micro_batch_token_mean": "token mean within each micro-batch, then mean over micro-batches",
    "max_length": "token sum / (N x L_max)",
    "batch_token_mean": "token sum / T",
    "sequence_sum": "token sum / N: each completion's loss times its length \\|o_i\\|, mean over the N completions",
}


def loss_variant(loss_type: str) -> LossVariant:
    """A registered type by name, or a user's `LossVariant` by import path (`path/to/file.py:NAME` or
    `package.module:NAME`, found as rewards are: user_functions.py)."""
    variant = LOSS_VARIANTS.get(loss_type)
    if variant is not None:
        return variant
    if ":" not in loss_type:
        raise ValueError(
            f"unknown loss_type {loss_type!r}; expected one of {tuple(LOSS_VARIANTS)} or a LossVariant by import path "
            "('path/to/file.py:NAME' or 'package.module:NAME')"
        )
    from .errors import ConfigError
    from .user_functions import resolve_function

    found = resolve_function(loss_type, "loss.type", "loss type", ConfigError)
    if not isinstance(found, LossVariant):
        raise ConfigError(
            f"loss.type: {loss_type!r} is a {type(found).__name__}, not a grpo_trainer.losses.LossVariant"
        )
    if not issubclass(found.options, LossOptions):
        raise ConfigError(f"loss.type: {loss_type!r}: its options model must subclass grpo_trainer.losses.LossOptions")
    return found


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str | LossVariant,
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
    aggregation = (loss_type if isinstance(loss_type, LossVariant) else loss_variant(loss_type)).aggregation
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
# `loss.tis_cap: auto` on an engine whose log-probs differ from the trainer's (vLLM): truncated importance sampling
# per token at C = 2, as Yao et al. 2025 ran it and TRL's default was until its #4530 (docs/async.md, "The default
# correction", says why this and not TRL's sequence_mask at 3, prime-rl's masked loss or IcePop).
DEFAULT_TIS_CAP = 2.0


def teacher_advantage(
    teacher_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation's per-token advantage term [B, T] (detached), added to the group advantage:

        coef * (log pi_teacher(y_t) - log mu(y_t))

    for the sampled token y_t, mu the policy that sampled it. Its expectation over mu's samples is -coef times
    the per-token reverse KL(mu || pi_teacher), so a policy-gradient step on it lowers that KL: the dense reward of
    on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), arXiv 2306.13649, with its reverse-KL divergence; Lu & Thinking Machines Lab
    2025, "On-Policy Distillation": the per-token reverse KL as the advantage, no discounting). Each token is
    rewarded for itself (no sum over later tokens) and the term is not scaled with the group's rewards. 0 off the
    `mask` (padding, masked completions)."""
    return (coef * (teacher_logp - behaviour_logp) * mask).detach()


def importance_weight(
    old_logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    mode: str = "token_truncate",
    floor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout correction for a sampler (e.g. vLLM) that scores tokens slightly differently from the trainer, or
    sampled them with older weights (asynchronous rollouts, docs/async.md): per-token weight [B, T] (detached) for
    `per_token_loss`'s `sampler_weight`, and which real tokens fell outside [floor, cap] [B, T] (bool).

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


def mismatch_kl(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """The per-token k3 estimate [B, T] of KL(pi_sampler || pi_trainer) for tokens the sampler drew:

        k3 = exp(d) - 1 - d,   d = log pi_trainer(y_t) - log pi_sampler(y_t)

    Schulman's estimator, as `kl_k3` to the reference (exp(ref - logp) - (ref - logp) - 1) with the sampler in the
    policy's place (it drew the tokens) and the trainer in the reference's: >= 0 for every token, 0 where the two
    agree, and its mean over the sampler's tokens is unbiased for the KL, since E_mu[pi / mu] = 1. prime-rl logs the same quantity as `mismatch_kl` (trainer/rl/loss.py,
    `compute_importance_ratio_and_mismatch_kl`: ratio - log_ratio - 1, log_ratio = trainer - inference). Not masked:
    the caller averages it over the tokens that count. In float64, with expm1 (not exp(d) - 1 as `kl_k3`): with
    engines that agree to d ~ 3e-7 (float32 vLLM) k3 ~ 4.5e-14, which float32's exp rounds to 0 (its spacing at 1 is
    1.2e-7) and float32's expm1 still gets 25% wrong. d itself is exact: the difference of two close float32s."""
    d = (trainer_logp - sampler_logp).double()
    return torch.expm1(d) - d


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
