"""The frozen teacher of on-policy distillation (`teacher:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import _Section
from .model import ModelConfig, _not_empty


class TeacherConfig(_Section):
    """A frozen model that scores every sampled token (on-policy distillation, `loss.teacher_kl`)."""

    name_or_path: str = Field(
        description="Hugging Face model id, local folder or builtin (as model.name_or_path); its tokenizer's "
        "vocabulary must be the policy's.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Parameter dtype of the teacher (None: model.dtype)."
    )
    trust_remote_code: bool = Field(False, description="Passed to `from_pretrained`.")

    @field_validator("name_or_path")
    @classmethod
    def _name_not_empty(cls, value: str) -> str:
        return _not_empty(value)

    def as_model(self, policy: ModelConfig) -> ModelConfig:
        """The teacher as a model entry to load (models.load_causal_lm, load_tokenizer): frozen, no adapters, the
        policy's log-prob chunking."""
        return policy.model_copy(
            update={
                "name_or_path": self.name_or_path,
                "dtype": self.dtype or policy.dtype,
                "tokenizer": None,
                "trust_remote_code": self.trust_remote_code,
                "gradient_checkpointing": False,
                "lora": None,
            }
        )
