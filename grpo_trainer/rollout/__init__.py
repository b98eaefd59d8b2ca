"""Rollout engines: sample G completions for each prompt.

An engine is anything with `generate(prompt_ids, num_generations) -> Rollout`
and `sync_weights(model)`. The trainer only talks to that interface, so the
`hf` engine (transformers generate, everywhere) and vLLM engines (GPUs) are
interchangeable. `build_engine` is the registry: engines are imported lazily,
so nothing from vLLM is imported unless it is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Rollout:
    """Completions for a list of prompts, grouped: rows i*G .. i*G+G-1 belong to prompt i."""

    completion_ids: list[list[int]]  # each ends with EOS unless truncated
    truncated: list[bool]  # True when max_completion_length was reached without EOS
    # Per-token log-probs under the sampler, when the engine reports them (for the
    # sampler/trainer mismatch metric); same lengths as completion_ids.
    sampling_logprobs: list[list[float]] | None = None
    stats: dict[str, float] = field(default_factory=dict)


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        """G completions per prompt. With `seeds`, prompt i's group is drawn from seeds[i] alone, so the
        result does not depend on batching or on how prompts are split over ranks."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the sampler use the trainer's current weights."""


def build_engine(name: str, **kwargs) -> RolloutEngine:
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(**kwargs)
    if name == "vllm_colocate":
        from .vllm_colocate import VLLMColocateEngine

        return VLLMColocateEngine(**kwargs)
    if name == "vllm_server":
        from .vllm_server import VLLMServerEngine

        return VLLMServerEngine(**kwargs)
    raise ValueError(f"rollout.engine: unknown engine {name!r}")
