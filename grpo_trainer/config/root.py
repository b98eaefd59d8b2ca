"""The root of the tree: every section, and the checks that span sections."""

from __future__ import annotations

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from ..geometry import geometry_of
from ..losses import LOSS_VARIANTS
from .base import CHANGES_MEANING, HARMLESS_ON_RESUME, _Section, _section_of
from .checkpoint import CheckpointConfig
from .data import DataConfig
from .environment import EnvironmentConfig
from .eval import EvalConfig
from .logging import LoggingConfig
from .loss import LossConfig
from .model import ModelConfig
from .rewards import RewardConfig
from .rollout import RolloutConfig
from .teacher import TeacherConfig
from .train import TrainConfig


class Config(_Section):
    output_dir: str = Field(
        "outputs/run",
        description="Where metrics, checkpoints and the final model go.",
        json_schema_extra=HARMLESS_ON_RESUME,
    )
    seed: int = Field(
        0,
        description="Seeds sampling, shuffling and initialisation (each rank adds its index).",
        json_schema_extra=CHANGES_MEANING,
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    teacher: TeacherConfig | None = Field(
        None,
        json_schema_extra=CHANGES_MEANING,
        description="A frozen teacher model for on-policy distillation (used with loss.teacher_kl > 0).",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Where prompts come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Group sampling.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig,
        description="Stateful environments, one per conversation (multi-turn episodes; docs/environments.md).",
    )
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="math_accuracy")],
        description="Rewards summed (with weights) into the scalar reward.",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss and advantages.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Evaluation on held-out prompts.", json_schema_extra=HARMLESS_ON_RESUME
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Saving and resuming.", json_schema_extra=HARMLESS_ON_RESUME
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Metrics and console output.", json_schema_extra=HARMLESS_ON_RESUME
    )

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, value: str) -> str:
        if not value.strip():  # Path("") is the current folder: the run would write there
            raise ValueError("empty: name the folder the run writes to (e.g. outputs/run)")
        return value

    @model_validator(mode="after")
    def _resolve_correction(self) -> Config:
        """`loss.tis_cap: auto` becomes the number (or null) the engine's entry asks for, here where the engine is
        known: every reader sees a resolved value, and a run's saved config records it (an hf run's `null`, as
        before `auto` existed). Left out of the section's set fields, so `loss.tis_cap_by_default` still tells."""

        loss = self.loss
        if not (loss.tis_cap_by_default or loss.tis_cap == "auto"):
            return self
        value = loss.auto_tis_cap(self.rollout.sampler_logprobs_differ)
        if loss.tis_cap != value:
            loss = loss.model_copy()  # a section given as an object may be another config's: never changed in place
            loss.__dict__["tis_cap"] = value  # set, not assigned: the resolution is no choice of the user's
            loss.model_fields_set.discard("tis_cap")  # (an explicit `auto` is the default too)
            self.__dict__["loss"] = loss
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        if not self.rewards and self.environment.kind is None and not self.loss.teacher_only:
            raise ValueError(
                "rewards: at least one reward is needed (or an environment that scores its episodes, or "
                "loss.teacher_only with a teacher: pure distillation needs none)"
            )
        if self.environment.kind is not None:
            self._check_environment()
        geometry_of(self)  # prompts, mini-batches and micro-batches fit together (geometry.py says how)
        if self.loss.advantage == "reinforce_pp" and self.loss.scale_rewards != "batch":
            raise ValueError(
                "loss.advantage reinforce_pp divides by the batch std of the group-centred rewards: "
                f"set loss.scale_rewards to batch (got {self.loss.scale_rewards})"
            )
        cap = self.loss.correction_cap  # resolved above
        if self.loss.tis_min is not None and (cap is None or self.loss.tis_min >= cap):
            raise ValueError(
                f"loss.tis_min ({self.loss.tis_min}) is the lower end of [tis_min, tis_cap]: set loss.tis_cap above it "
                f"(got tis_cap {cap})"
            )
        self._check_teacher()
        if self.rollout.lora_sync == "adapter":
            from ..rollout.engines import lora_config_refusal

            lora = self.model.lora
            reason = lora_config_refusal(
                None if lora is None else lora.r, self.rollout.engine, self.rollout.vllm_server.weights_dir
            )
            if reason is not None:
                raise ValueError(
                    f"rollout.lora_sync=adapter: {reason} (rollout.lora_sync=auto pushes merged weights instead)"
                )
        if (
            self.loss.variant.sampler_weight_in_ratio
            and self.loss.correction_on
            and self.loss.tis_mode.startswith("sequence")
        ):
            raise ValueError(
                f"loss.type {self.loss.type} folds the per-token rollout correction into its own ratio: set loss.tis_mode "
                f"to token_truncate or token_mask (got {self.loss.tis_mode})"
            )
        return self

    def _check_environment(self) -> None:
        env = self.environment
        if not self.data.use_chat_template and env.kind not in ("agent", "verifiers"):  # they render their own prompts
            raise ValueError(
                f"environment.{env.kind} needs data.use_chat_template: environment messages are rendered by the chat template"
            )
        if self.environment.tools and env.kind != "factory":
            raise ValueError(
                f"environment.tools beside environment.{env.kind}: only environment.factory takes extra tools"
            )

    def _check_teacher(self) -> None:
        """The teacher, loss.teacher_kl and loss.teacher_only come together, with a loss whose ratio is per token."""
        loss = self.loss
        if loss.teacher_on and self.teacher is None:
            raise ValueError(f"loss.teacher_kl ({loss.teacher_kl}) needs a teacher: set teacher.name_or_path")
        if self.teacher is not None and not loss.teacher_on:
            raise ValueError(
                "teacher is set but loss.teacher_kl is 0: it would be loaded and never used; set "
                "loss.teacher_kl > 0 (e.g. 1.0), or remove teacher"
            )
        if loss.teacher_only and not loss.teacher_on:
            raise ValueError(
                "loss.teacher_only needs loss.teacher_kl > 0 (the teacher term is then the whole advantage)"
            )
        if loss.teacher_on and loss.variant.ratio != "token":
            raise ValueError(
                f"loss.teacher_kl: loss.type {loss.type} has one ratio per sequence ({loss.variant.ratio}), which a "
                "per-token advantage cannot weight token by token; use a token-level type: "
                + ", ".join(name for name, v in LOSS_VARIANTS.items() if v.ratio == "token")
            )
        if loss.teacher_only and loss.dynamic_sampling:
            raise ValueError(
                "loss.teacher_only with loss.dynamic_sampling: without rewards in the advantage every group "
                "counts, and dynamic sampling would drop the groups whose rewards are equal; turn it off"
            )

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is loaded for the KL term: beta > 0, and not LoRA (whose reference is the
        policy with its adapters switched off)."""
        return self.loss.kl_on and self.model.lora is None

    def dump_unresolved(self) -> dict:
        """The config as a JSON-able dict that validates back to this config, defaults still unresolved where the
        user left them (`loss.tis_cap: auto`): what a config is rebuilt from within a run (`with_absolute_paths`,
        a Config given to the Python API). What a run saves is `model_dump`, with the values resolved."""
        data = self.model_dump(mode="json")
        if self.loss.tis_cap_by_default:
            data["loss"]["tis_cap"] = "auto"
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def resume_effect(key: str) -> str | None:
    """What changing the dotted config `key` on resume means, as its field (or a section above it) declares with
    `json_schema_extra=CHANGES_MEANING` / `HARMLESS_ON_RESUME`: "meaning", "harmless", or None (allowed with a
    warning). checkpoint.check_resume_compatible reads it; the schema is the one place it is written."""
    model: type[BaseModel] | None = Config
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        extra = field.json_schema_extra  # a dict here (CHANGES_MEANING, ...); pydantic also allows a callable
        effect = extra.get("resume") if isinstance(extra, dict) else None
        if isinstance(effect, str):
            return effect
        model = _section_of(field.annotation)
    return None
