"""The reward entries (`rewards:`): functions and learned reward models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import _Section

REWARD_MODEL_NAME = "reward_model"  # the `name` of a reward entry that scores with `model`


class RewardModelConfig(_Section):
    """A learned reward model: a sequence-classification model with one output, scoring prompt + completion."""

    path: str = Field(
        ...,
        description="Folder (or hub id) of an `AutoModelForSequenceClassification` with num_labels=1, with its tokenizer.",
    )
    batch_size: int = Field(16, gt=0, description="Texts per reward-model forward pass (on each rank).")
    max_length: int | None = Field(
        None,
        gt=0,
        description="Tokens per scored text; a longer one loses its start (the end, where the score is read, is kept) "
        "and is counted in rewards/<name>/truncated. None: the reward model's context length.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype of the reward model; `auto`: the policy's `model.dtype`."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template overriding the reward model tokenizer's own (None: its own; without one, "
        "prompt and completion are scored as plain text).",
    )


class RewardConfig(_Section):
    name: str = Field(
        ...,
        description="A built-in reward (`math_accuracy`, `think_format`, `code_tests`, `overlong_penalty`), `path/to/file.py:function` or `package.module:function`; `reward_model` for an entry with `model` (implied there).",
    )
    model: RewardModelConfig | None = Field(
        None,
        description="Score with a learned reward model instead of a function; `model: PATH` is short for "
        "`model: {path: PATH}`. See docs/rewards.md.",
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum that forms the scalar reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the reward on every call."
    )
    alias: str | None = Field(None, description="Name used in metrics (default: the function's name).")
    timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds one call on a batch may take (None: no limit; built-ins keep their own per-sample limits).",
    )
    on_timeout: Literal["error", "none"] = Field(
        "error",
        description="A call over `timeout`: `error` stops the run naming the reward and the sample; `none` scores "
        "that batch None (no opinion) and counts it in rewards/<name>/timed_out_batches.",
    )

    @model_validator(mode="before")
    @classmethod
    def _reward_model_shorthand(cls, data: Any) -> Any:
        """`model: PATH` -> `model: {path: PATH}`; an entry with `model` is the reward `reward_model`."""
        if isinstance(data, dict) and data.get("model") is not None:
            data = {**data, "name": data.get("name", REWARD_MODEL_NAME)}
            if isinstance(data["model"], str):
                data["model"] = {"path": data["model"]}
        return data

    @model_validator(mode="after")
    def _reward_model_entry(self) -> RewardConfig:
        if self.model is not None and self.name != REWARD_MODEL_NAME:
            raise ValueError(
                f"`model` makes this entry a reward model (name `{REWARD_MODEL_NAME}`); remove `name: {self.name}` "
                "(a function needs an entry of its own) and name the reward model in metrics with `alias`"
            )
        if self.model is None and self.name == REWARD_MODEL_NAME:
            raise ValueError(
                f"`name: {REWARD_MODEL_NAME}` needs `model: PATH` (a sequence-classification model folder)"
            )
        if self.model is not None and self.kwargs:
            raise ValueError("`kwargs` are passed to reward functions; a reward model's settings go under `model`")
        return self
