"""Optimisation (`train:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import CHANGES_MEANING, HARMLESS_ON_RESUME, _Section


class TrainConfig(_Section):
    max_steps: int = Field(
        100,
        gt=0,
        description="Training steps: each samples one generation batch and takes num_iterations optimizer steps on it.",
        json_schema_extra=HARMLESS_ON_RESUME,
    )
    prompts_per_step: int = Field(
        8,
        gt=0,
        description="Prompts per generation batch, over all ranks; each yields num_generations completions.",
        json_schema_extra=CHANGES_MEANING,
    )
    micro_batch_size: int = Field(
        16,
        gt=0,
        description="Completions per forward/backward pass on each rank (gradient accumulation covers the rest).",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Instead of micro_batch_size: each forward/backward pass holds at most this many tokens (a group's "
        "prompt once, plus its completions; padding included where there is any), so memory is set by this budget, not by "
        "the longest completion. The number of passes then follows the step's tokens; every rank makes the same number. "
        "A group too long for it is split over passes (its prompt runs once in each).",
    )
    packing: bool = Field(
        False,
        description="Prefix-shared packing in the training passes: a group is laid out as its prompt once, then its "
        "completions back to back, each attending to the prompt and to itself; short groups share a row. No "
        "completion is padded to the longest. Same numbers as the padded layout up to float rounding "
        "(docs/performance.md); model.share_prompt then concerns sampling only. Needs sdpa or eager attention.",
    )
    num_iterations: int = Field(1, ge=1, description="mu: optimizer steps taken on each generation batch.")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over a generation batch (PPO mini-batches, whole groups each): "
        "num_iterations x mini_batches steps per batch, all against the sampling-time policy.",
        json_schema_extra=CHANGES_MEANING,
    )
    skip_zero_advantage: bool = Field(
        True,
        description="With loss.beta = 0 and no entropy term, leave completions whose advantage is 0 (or whose tokens "
        "are all masked) out of the forward/backward passes: their gradient is exactly 0. Normalisers still count them, so the update is "
        "unchanged; `entropy` then covers the trained completions. Not applied to `bnpo` (normalised per micro-batch).",
    )
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate shape after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup over this many optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this (None: no clipping)."
    )
    max_consecutive_nonfinite: int = Field(
        3,
        ge=0,
        description="Optimizer steps with a NaN/inf loss or gradient are skipped; stop after this many in a row.",
    )
    max_consecutive_unscored: int = Field(
        3,
        ge=0,
        description="Steps in which no reward scores any completion (each returns None or NaN for all: nothing "
        "to learn from), or the environment fails every episode, are warned about, naming the rewards or the first "
        "error; stop after this many in a row.",
    )
    trim_host_memory: bool | None = Field(
        None,
        description="Hand the C heap's free pages back to the system at the points where a step's phases peak "
        "(glibc's malloc_trim; grpo_trainer/cpu/heap.py): a lower resident peak for a few percent of step time on "
        "the CPU (docs/performance.md). None: on where the policy trains on the CPU and its weights fill 64 MiB or more "
        "(below, the trims cost more than they save); no effect on GPU memory.",
    )

    @property
    def policy_moves_within_step(self) -> bool:
        """The policy takes more than one optimizer step on a generation batch (num_iterations or mini_batches > 1):
        the sampling-time ("old") log-probs then differ from the current ones and must be computed before the update,
        and the ratio can leave 1 (clipping happens)."""
        return self.num_iterations > 1 or self.mini_batches > 1
