"""The batch geometry: how one step's batch is laid out over ranks, mini-batches and micro-batches.

One source for every count that config validation, preflight, the learning-rate schedule and the phases
need, so they cannot disagree (preflight once counted optimizer steps without `train.mini_batches` while
the scheduler counted them):

    prompts_per_step prompts  -> world ranks, `prompts_per_rank` each (a contiguous slice)
    each prompt               -> G completions (`group_size`)
    each rank's completions   -> `mini_batches` mini-batches of whole groups (one optimizer step each)
    each mini-batch           -> micro-batches (one forward/backward each): a fixed count,
                                 `accumulation_steps`, with `train.micro_batch_size`; with
                                 `train.micro_batch_tokens` as many as the step's tokens need, agreed by
                                 all ranks (batches.py), so `accumulation_steps` is None
    a run                     -> max_steps x num_iterations x mini_batches optimizer steps

Free of torch and of the config module (which validates through it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Geometry:
    world: int
    rank: int
    prompts_per_rank: int
    group_size: int  # G
    mini_batches: int = 1  # optimizer steps per pass over the batch
    micro_batch_size: int | None = None  # completions per micro-batch; None: a token budget decides
    micro_batch_tokens: int | None = None  # tokens per micro-batch at most (train.micro_batch_tokens)
    num_iterations: int = 1
    max_steps: int = 1

    @property
    def completions_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size

    @property
    def total_completions(self) -> int:
        return self.completions_per_rank * self.world

    @property
    def completions_per_mini_batch(self) -> int:
        """On one rank."""
        return self.completions_per_rank // self.mini_batches

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches (backward passes) per rank and optimizer step, when fixed by `micro_batch_size`;
        None under a token budget, where each step's batch decides (`batches.TrainBatch.window_sizes`)."""
        if self.micro_batch_size is None:
            return None
        return self.completions_per_mini_batch // self.micro_batch_size

    @property
    def optimizer_steps_per_batch(self) -> int:
        return self.num_iterations * self.mini_batches

    @property
    def optimizer_steps(self) -> int:
        """Optimizer (and learning-rate schedule) steps of the whole run."""
        return self.max_steps * self.optimizer_steps_per_batch

    def check_room(self, longest_prompt: int, max_completion_length: int) -> None:
        """Under a token budget, the longest prompt with a completion of the longest kind must fit in one pass;
        checked when the prompts are known, so a run does not stop at the first long completion."""
        need = longest_prompt + max_completion_length
        if self.micro_batch_tokens is not None and need > self.micro_batch_tokens:
            raise ConfigError(
                f"train.micro_batch_tokens ({self.micro_batch_tokens}) cannot hold the longest prompt ({longest_prompt} "
                f"tokens) with a completion of rollout.max_completion_length ({max_completion_length}): set it to at "
                f"least {need}"
            )

    def my_prompts(self, batch: list) -> list:
        """This rank's contiguous slice of a list with one item per prompt of the whole batch."""
        return batch[self.rank * self.prompts_per_rank : (self.rank + 1) * self.prompts_per_rank]

    def my_completions(self, values):
        """This rank's slice of a tensor with one row per completion of the whole batch."""
        n = self.completions_per_rank
        return values[self.rank * n : (self.rank + 1) * n]


def geometry_of(cfg: Any, world: int = 1, rank: int = 0) -> Geometry:
    """The geometry of `cfg` (a `config.Config`) on `world` ranks; ValueError naming the keys to change.

    With world = 1 this is what config validation checks; `run.build_run` checks the launched world."""
    train, g = cfg.train, cfg.rollout.num_generations
    if train.prompts_per_step % world:
        raise ValueError(
            f"train.prompts_per_step ({train.prompts_per_step}) must be divisible by the number of processes ({world})"
        )
    budget = train.micro_batch_tokens
    geometry = Geometry(
        world=world,
        rank=rank,
        prompts_per_rank=train.prompts_per_step // world,
        group_size=g,
        mini_batches=train.mini_batches,
        micro_batch_size=None if budget else train.micro_batch_size,
        micro_batch_tokens=budget,
        num_iterations=train.num_iterations,
        max_steps=train.max_steps,
    )
    scope = "per step" if world == 1 else "per process"
    formula = "train.prompts_per_step" + ("" if world == 1 else f" / {world} processes") + " x rollout.num_generations"
    completions = f"{scope} ({formula} = {geometry.completions_per_rank})"
    per_mini, rest = divmod(geometry.prompts_per_rank, geometry.mini_batches)
    if rest:
        raise ValueError(
            f"train.mini_batches ({train.mini_batches}) must divide the prompts {scope} ({geometry.prompts_per_rank}): "
            "every mini-batch takes whole groups, the same number on every process"
        )
    micro = geometry.micro_batch_size
    if micro is None:
        if budget <= cfg.rollout.max_completion_length:
            raise ValueError(
                f"train.micro_batch_tokens ({budget}) must be larger than rollout.max_completion_length "
                f"({cfg.rollout.max_completion_length}): one completion and its prompt must fit in a pass"
            )
        return geometry
    if micro > geometry.completions_per_rank:
        raise ValueError(f"train.micro_batch_size ({micro}) is larger than the completions {completions}")
    if geometry.completions_per_rank % micro:
        raise ValueError(f"train.micro_batch_size ({micro}) must divide the completions {completions}")
    if (per_mini * g) % micro:
        raise ValueError(
            f"train.micro_batch_size ({micro}) must divide the completions of one mini-batch "
            f"({per_mini} prompts x {g} generations, with train.mini_batches={train.mini_batches}); "
            "or set train.micro_batch_tokens instead"
        )
    return geometry


def batch_geometry(cfg: Any, world: int, rank: int = 0) -> Geometry:
    """`geometry_of` for the launched world, failing as a ConfigError (what `train` reports in one line)."""
    try:
        return geometry_of(cfg, world, rank)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
