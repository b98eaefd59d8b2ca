"""Where prompts come from (`data:`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import CHANGES_MEANING, _Section


class DataConfig(_Section):
    source: str = Field(
        "builtin:arithmetic",
        description="`builtin:arithmetic`, `builtin:word_problems`, `builtin:multiplication` (the tools demo) or "
        "`builtin:guess_number` (the environments demo), a local "
        ".json/.jsonl/.parquet/.csv file, or a "
        "Hugging Face dataset id. `object:train_dataset@FINGERPRINT` names a dataset given to `grpo_trainer.train()` "
        "in Python (docs/python_api.md).",
        json_schema_extra=CHANGES_MEANING,
    )
    subset: str | None = Field(
        None, description="Dataset configuration name (Hugging Face datasets only).", json_schema_extra=CHANGES_MEANING
    )
    split: str = Field("train", description="Split to train on.", json_schema_extra=CHANGES_MEANING)
    prompt_column: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of chat messages.",
        json_schema_extra=CHANGES_MEANING,
    )
    answer_column: str = Field(
        "answer",
        description="Column holding the reference answer; passed to rewards as `answer` as well as under its own name.",
        json_schema_extra=CHANGES_MEANING,
    )
    system_prompt: str | None = Field(
        None,
        description="System message prepended to every prompt (chat template only).",
        json_schema_extra=CHANGES_MEANING,
    )
    use_chat_template: bool = Field(
        True, description="Format prompts with the tokenizer's chat template.", json_schema_extra=CHANGES_MEANING
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own.", json_schema_extra=CHANGES_MEANING
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3.",
    )
    max_prompt_length: int | None = Field(
        None, gt=0, description="Prompts longer than this many tokens are an error (None: the model's context decides)."
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by `seed`).")
    num_samples: int | None = Field(
        None,
        gt=0,
        description="Use only the first N records (after loading, before shuffling).",
        json_schema_extra=CHANGES_MEANING,
    )
    skip_invalid_rows: bool = Field(
        False,
        description="Records with no value in a column a reward reads (e.g. the answer) are an error at load time; "
        "true: leave them out and say how many.",
    )
    eval_source: str | None = Field(None, description="Where evaluation prompts come from (None: data.source).")
    eval_split: str | None = Field(None, description="Split for evaluation (None: `test`).")
