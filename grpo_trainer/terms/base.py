"""The interface of an optional loss term (the registry is this package's `__init__`).

A term is an object with up to three hooks, each optional, that `update.micro_batch_loss` calls per micro-batch
in the order of `TERMS`:
- `advantage`: the per-token advantage [B, T] the surrogate sees, from the one it is given (the teacher's term);
- `weight`: a per-token weight [B, T] (detached) of the policy term (the rollout correction, off-policy masking);
- `add`: what joins the loss: per token, before aggregation (KL to the reference), or to the micro-batch's share
  after it (the entropy bonus, normalised on its own).
Around them: `annotate` (a per-token annotation scored before the update, without gradient: the reference's or
the teacher's log-probs), `for_step`/`after_step` (a term's per-step state: the entropy coefficient), and
`metrics`, the term's logged metrics from the sums it recorded (`record`), reduced over ranks with the step's.
Each sum declares how it adds up over a step (`Sum`): so the update accumulates every term's statistics
without knowing its names.

A new term is a subclass in its own module, one line in the package's `TERMS`, and its keys in the config's `loss`
section. The math stays in `losses` (pure functions); a term only wires it to a micro-batch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..batches import MicroBatch, TrainBatch
    from ..config import Config
    from ..train_state import TrainState


class Sum(enum.Enum):
    """How one statistic adds up over a step's passes (every micro-batch, `train.num_iterations` times)."""

    FIRST = "first"  # the first pass only (what the sampling-time policy saw)
    PASS = "pass"  # every pass, averaged over the passes (each covers every token once)
    SHARE = "share"  # a part of the loss: averaged over the optimizer steps, as the logged loss is


@dataclass
class TermInputs:
    """What a term's hooks see of one micro-batch, all [B, T] unless said: `logp` (with its gradient), `old_logp`
    (the ratio's denominator), `behaviour_logp` (the policy that sampled: the sampler's, or `old_logp` without
    them), `entropy` (or None), `advantages` (after the terms before this one shaped them) and
    `sequence_advantages` [B] (one per completion: the group's, or the token mean of shaped ones)."""

    mb: MicroBatch
    logp: torch.Tensor
    old_logp: torch.Tensor
    behaviour_logp: torch.Tensor
    entropy: torch.Tensor | None
    advantages: torch.Tensor
    sequence_advantages: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # what the hooks recorded, for the step's stats

    @property
    def mask(self) -> torch.Tensor:
        return self.mb.mask

    def record(self, **sums: torch.Tensor) -> None:
        """This micro-batch's part of the term's sums (each declared in its `sums`)."""
        self.sums.update(sums)


@dataclass(frozen=True)
class Addition:
    """What an `add` hook adds: `token_loss` [B, T] to the per-token loss (aggregated with it, as the loss type
    aggregates), `share` (0-d) to the micro-batch's share of the loss."""

    token_loss: torch.Tensor | None = None
    share: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTotals:
    """What `metrics` divides by, over all ranks: the batch's kept tokens, the trained ones and completions, the
    step's loss, and whether the engine reported sampler log-probs."""

    loss: torch.Tensor
    tokens: float
    trained_tokens: float
    trained_completions: float
    sampler_logprobs: bool


class LossTerm:
    """An optional part of the loss. Subclasses set `name` and `sums` and override the hooks they use."""

    name: ClassVar[str]
    sums: ClassVar[Mapping[str, Sum]] = {}
    # Gives gradient where a completion's group advantage is 0, so such completions cannot skip the passes.
    acts_at_zero_advantage: ClassVar[bool] = True
    # The weight corrects for who sampled the tokens (pi_old / pi_sampler): a loss type whose ratio absorbs that
    # correction (`LossVariant.sampler_weight_in_ratio`) takes it there; other weights multiply the policy term.
    weights_sampler: ClassVar[bool] = False
    needs_entropy_grad: ClassVar[bool] = False  # reads `entropy` with its gradient, in every pass

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        """Whether the config asks for this term."""
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: Config, models: TermModels) -> LossTerm:
        raise NotImplementedError

    def annotate(self, mb: MicroBatch) -> torch.Tensor | None:
        """Before the update, without gradient: a per-token tensor kept as `mb.annotations[self.name]`."""
        return None

    def for_step(self, batch: TrainBatch, comm, state: TrainState) -> LossTerm:
        """The term as this step applies it (a collective where it counts over ranks); itself by default."""
        return self

    def advantage(self, inputs: TermInputs) -> torch.Tensor | None:
        return None

    def weight(self, inputs: TermInputs) -> torch.Tensor | None:
        return None

    def add(self, inputs: TermInputs) -> Addition | None:
        return None

    def after_step(self, sums: Mapping[str, torch.Tensor], comm, state: TrainState) -> TrainState:
        """The state after the step, from this rank's sums (a collective where it reads all ranks')."""
        return state

    def metrics(self, sums: Mapping[str, torch.Tensor], totals: StepTotals) -> dict[str, float]:
        """The logged metrics, from the sums over all ranks."""
        return {}


def shapes_advantages(terms: tuple[LossTerm, ...]) -> bool:
    """Some term gives each token its own advantage: every kept token can carry policy gradient."""
    return any(type(term).advantage is not LossTerm.advantage for term in terms)


@dataclass(frozen=True)
class TermModels:
    """The frozen models the builder loaded for the terms: per-token log-prob scorers, called as
    `models.TokenLogprobs` is (`scorer(**sequences)[0]` is [B, T])."""

    reference: Callable[..., Any] | None = None  # beta > 0: the reference (LoRA: the policy, adapters off)
    teacher: Callable[..., Any] | None = None  # loss.teacher_kl > 0
