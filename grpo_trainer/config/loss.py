"""The policy loss and advantages (`loss:`); each loss type's options are checked by the type's own model."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from ..advantages import ESTIMATORS
from ..errors import UserError
from ..losses import DEFAULT_TIS_CAP, IS_MODES, LOSS_VARIANTS, LossOptions, LossVariant, loss_variant
from .base import CHANGES_MEANING, _asks_a_number, _Section

ScaleRewards = Literal["group", "batch", "none"]
if TYPE_CHECKING:  # a Literal built from a registry's names at run time is a plain str to a type checker
    AdvantageEstimator = str
    ImportanceSamplingMode = str
else:
    AdvantageEstimator = Literal[ESTIMATORS]  # advantages.ESTIMATORS
    ImportanceSamplingMode = Literal[IS_MODES]  # losses.IS_MODES


class LossConfig(_Section):
    type: str = Field(
        "grpo",
        description="The loss type: a name from the registry (`loss.type` values below; docs/loss_family.md) or your own `grpo_trainer.losses.LossVariant` by import path, "
        '`path/to/file.py:NAME` or `package.module:NAME` (docs/loss_family.md, "Your own loss type").',
        json_schema_extra=CHANGES_MEANING,
    )
    options: SerializeAsAny[LossOptions] = Field(
        default_factory=lambda: LOSS_VARIANTS["grpo"].options(),
        description="The options of `loss.type`, checked by its own model (the tables below); an option of another "
        "type is an error naming the types that read it. The flat keys of earlier versions (`loss.epsilon_low`, "
        "`loss.sapo_temperature_pos`, ...) are read into these.",
    )
    beta: float = Field(
        0.0, ge=0, description="KL coefficient to the frozen reference (0: no reference model is loaded)."
    )
    tis_cap: float | Literal["auto"] | None = Field(
        "auto",
        description="The rollout correction (truncated or masked importance sampling): weight tokens by "
        "min(pi_old/pi_sampler, cap) (`tis_mode`) where the engine reports the sampler's log-probs. `auto`: "
        f"{DEFAULT_TIS_CAP:g} on engines whose log-probs differ from the trainer's (vllm_colocate, vllm_server), off on hf "
        "(it samples with the trainer's own weights); a run records the value it resolved to, and a resumed run whose "
        "config leaves this at auto keeps its checkpoint's. `null` (or `off`): no correction on any engine; a positive number: "
        'that cap on every engine (docs/async.md, "The default correction").',
    )
    tis_min: float | None = Field(
        None,
        gt=0,
        description="Lower bound of the ratio pi_old/pi_sampler (TRL's vllm_importance_sampling_clip_min): `*_mask` "
        "modes zero what falls outside [tis_min, tis_cap], `*_truncate` modes clamp it into that range. IcePop "
        "(Ring-1T): tis_mode token_mask, tis_min 0.5, tis_cap 5 (or [1/k, k]). Needs tis_cap.",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0,
        description="delta: off-policy sequence masking (DeepSeek-V3.2): a completion with advantage < 0 whose mean "
        "log-ratio log pi_sampler - log pi_theta over its tokens exceeds delta carries no policy gradient (TRL's name; "
        "0.5 is a starting point). Without sampler log-probs (hf engine) pi_old stands in. Logged: "
        "sampling/off_policy_masked_fraction.",
    )
    tis_mode: ImportanceSamplingMode = Field(
        "token_truncate",
        description="With tis_cap: the ratio pi_old/pi_sampler per token (`token_*`) or its product over the "
        "completion (`sequence_*`), capped at tis_cap (`*_truncate`) or zeroed above it (`*_mask`); TRL's "
        "vllm_importance_sampling_mode. Logged: the fraction of trained tokens touched (capped or zeroed), "
        "sampling/is_truncated_fraction or sampling/is_masked_fraction, and of trained completions, "
        "sampling/is_truncated_sequence_fraction or sampling/is_masked_sequence_fraction.",
    )
    advantage: AdvantageEstimator = Field(
        "grpo",
        description="Baseline: `grpo` (group mean), `rloo` (mean of the other G-1 rewards), `reinforce_pp` (group "
        "mean, then divided by the batch std of the centred rewards; needs scale_rewards `batch`).",
        json_schema_extra=CHANGES_MEANING,
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Divide advantages by the group std (`group`), the batch std (`batch`) or not at all (`none`).",
    )
    reward_aggregation: Literal["sum", "normalize_then_sum"] = Field(
        "sum",
        description="`sum`: the weighted sum of the rewards; `normalize_then_sum`: normalise each reward within its "
        "group first, then the weighted sum (GDPO; TRL's multi_objective_aggregation). Logged rewards stay the plain sum.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="rho: only the top-rho highest-entropy completion tokens of the batch (entropy under the sampling "
        'policy) carry policy gradient ("Beyond the 80/20 Rule", 0.2 there); 1: all. Logged: entropy/masked_fraction.',
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="c: the loss becomes L - c * H, H the mean token entropy of the policy over the trained tokens (the "
        "top-entropy ones under top_entropy_quantile), for every loss type. With entropy_target: the starting value. "
        "Logged: entropy_coef, policy_loss, entropy/term_mean.",
    )
    entropy_target: float | None = Field(
        None,
        ge=0,
        description="Adaptive entropy control (Skywork-OR1): after each step c grows by entropy_coef_delta if the step's "
        "mean token entropy was below this (nats), else shrinks, within [entropy_coef_min, entropy_coef_max]; the term "
        "applies only while entropy is below it. Kept in checkpoints. None: c stays entropy_coef.",
    )
    entropy_coef_delta: float = Field(0.005, gt=0, description="With entropy_target: the step of c per training step.")
    entropy_coef_min: float = Field(0.0, ge=0, description="With entropy_target: the lower bound of c.")
    entropy_coef_max: float = Field(1.0, ge=0, description="With entropy_target: the upper bound of c.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts to refill.",
    )
    max_sampling_rounds: int = Field(
        3, ge=0, description="Extra generation rounds dynamic sampling may take per step before it gives up and warns."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions that hit max_completion_length out of the loss (DAPO)."
    )
    teacher_kl: float = Field(
        0.0,
        ge=0,
        json_schema_extra=CHANGES_MEANING,
        description="On-policy distillation: each token's advantage gains teacher_kl * (log pi_teacher - log "
        "pi_sampler) of the sampled token, the per-token reverse-KL reward (docs/distillation.md). Needs `teacher:`.",
    )
    teacher_only: bool = Field(
        False,
        json_schema_extra=CHANGES_MEANING,
        description="Pure distillation: the teacher term alone is the advantage (rewards are still computed and "
        "logged); zero-advantage skipping is off. Needs teacher_kl > 0.",
    )

    @property
    def variant(self) -> LossVariant:
        """The registry entry of `type` (or the user's, by import path)."""
        return loss_variant(self.type)

    @property
    def kl_on(self) -> bool:
        """The loss has a KL term to the reference (beta > 0): reference log-probs are computed and `kl` logged."""
        return self.beta > 0

    @property
    def correction_on(self) -> bool:
        """Rollout correction is configured (tis_cap, resolved): it weights the batches whose engine reports sampler
        log-probs. A section on its own leaves `auto` unresolved (the engine is the config's): off until then."""
        return self.correction_cap is not None

    @property
    def correction_cap(self) -> float | None:
        """tis_cap as a number, None where the correction is off (or `auto` is not resolved yet)."""
        return None if self.tis_cap == "auto" else self.tis_cap

    @property
    def tis_cap_by_default(self) -> bool:
        """tis_cap was left at (or set to) `auto` and resolved by the engine (`Config`): a resume keeps the value its
        checkpoint recorded instead (checkpoint.keep_recorded_correction)."""
        return "tis_cap" not in self.model_fields_set

    @staticmethod
    def auto_tis_cap(sampler_logprobs_differ: bool) -> float | None:
        """What `auto` stands for on an engine whose log-probs do (vLLM) or do not (hf) differ from the trainer's."""
        return DEFAULT_TIS_CAP if sampler_logprobs_differ else None

    @property
    def teacher_on(self) -> bool:
        """A teacher scores every sampled token and its per-token term joins the advantage (loss.teacher_kl > 0)."""
        return self.teacher_kl > 0

    @property
    def entropy_term(self) -> bool:
        """Whether the loss has an entropy term (its coefficient may still be 0 at times, under adaptive control)."""
        return self.entropy_coef > 0 or self.entropy_target is not None

    @field_validator("tis_cap", mode="before")
    @classmethod
    def _tis_cap_off(cls, value: Any) -> Any:
        """`off` (YAML reads it, and `false`, as False) is `null`; `true` is no number (the base's message); a
        string other than `auto` is read as a number (PyYAML reads `1e-1` as a string) or refused in one line."""
        if value is False:
            return None
        if isinstance(value, str) and value != "auto":
            try:
                return float(value)
            except ValueError:
                raise ValueError("expected a positive number, `auto`, or null / off (no correction)") from None
        return value

    @field_validator("tis_cap")
    @classmethod
    def _tis_cap_positive(cls, value: float | str | None) -> float | str | None:
        if isinstance(value, float) and value <= 0:
            raise ValueError("expected a positive number, `auto`, or null / off (no correction)")
        return value

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        try:
            loss_variant(value)
        except (ValueError, UserError) as exc:
            raise ValueError(str(exc).removeprefix("loss.type: ")) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _options_of_type(cls, data: Any, info: ValidationInfo) -> Any:
        """`options` validated by the model of `type`'s registry entry: a union discriminated by a key of the
        section above it, over an open set of members (a user's type by import path brings its own model).

        Each type reads only its own options: another type's option would silently do nothing, so it is an error
        naming the types that read it. The flat keys of earlier versions were moved here by `migrate` (the
        context's `written` names them as written)."""
        if not isinstance(data, dict) or not isinstance(data.get("type", "grpo"), str):
            return data
        data = dict(data)
        spec = data.get("type", "grpo")
        try:
            variant = loss_variant(spec)
        except (ValueError, UserError):
            data.pop("options", None)
            return data  # `type` reports it
        options = data.get("options")
        if options is None:
            options = {}
        elif isinstance(options, BaseModel):
            options = options.model_dump()
        if not isinstance(options, dict):
            raise ValueError(f"options: a mapping of the options of loss type {spec}, got {type(options).__name__}")
        options = dict(options)
        fields = variant.options.model_fields
        for key in data:
            hint = [] if key in cls.model_fields else difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            if hint:  # a misspelt option, once a flat key of loss: point at where options live now
                raise ValueError(f"{key}: unknown key; did you mean 'loss.options.{hint[0]}'?")
        for name in list(options):
            if name not in fields:
                readers = [v for v in LOSS_VARIANTS.values() if name in v.options.model_fields]
                if readers and all(options[name] == v.options.model_fields[name].default for v in readers):
                    del options[name]  # another type's option at its default (a recipe's loss.type overridden): no-op
                    continue
                whose = f"; it is read by: {', '.join(v.name for v in readers)}" if readers else ""
                raise ValueError(
                    f"options.{name} is not used by type {spec} (its options: {', '.join(fields) or 'none'})"
                    f"{whose}; set loss.options=null to start from type {spec}'s defaults"
                )
        written = {
            new.removeprefix("loss.options."): old.removeprefix("loss.")
            for new, old in ((info.context or {}).get("written") or {}).items()
            if new.startswith("loss.options.")
        }
        for name, value in options.items():  # as _Section: `true`/`false` is not a number
            if isinstance(value, bool) and _asks_a_number(fields[name].annotation):
                raise ValueError(f"{written.get(name, f'options.{name}')}: expected a number, not {str(value).lower()}")
        try:
            data["options"] = variant.options.model_validate(options)
        except ValidationError as exc:
            raise ValueError("; ".join(_option_error(err, variant, written) for err in exc.errors())) from None
        return data

    @model_validator(mode="after")
    def _check_loss_options(self) -> LossConfig:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) must not exceed entropy_coef_max ({self.entropy_coef_max})"
            )
        return self


def _option_error(err: ErrorDetails, variant: LossVariant, written_as: dict[str, str]) -> str:
    """One error of the type's options model, naming the key as the user wrote it."""
    name = ".".join(str(p) for p in err["loc"])
    written = written_as.get(name)
    where = (
        f"{written} (options.{name} of type {variant.name})" if written else f"options.{name}" if name else "options"
    )
    shown = "" if isinstance(err.get("input"), dict) else f" (got {err.get('input')!r})"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}{shown}"
