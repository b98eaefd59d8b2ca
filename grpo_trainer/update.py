"""Phases 4 and 5: the extra log-prob passes, then `num_iterations` x `mini_batches` optimizer steps -> `StepStats`.

Each micro-batch's loss is scaled so that gradient accumulation (Accelerate
divides by the accumulation steps) and the cross-rank gradient average add up to
exactly the batch loss `losses.aggregate` defines. The math is in `losses`, the optional terms (KL, teacher,
entropy, rollout correction, off-policy mask) in `terms`; this module only runs passes and counts. Each phase
is given what it reads (`Learner`, the terms, the collectives, a settings dataclass), not the run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import distributed, losses
from .batches import MicroBatch, TrainBatch
from .config import Config
from .errors import TrainingError
from .geometry import Geometry
from .samples import EpisodeStats
from .terms import LossTerm, StepTotals, Sum, TermInputs, shapes_advantages
from .train_state import TrainState

logger = logging.getLogger("grpo_trainer")


@dataclass(frozen=True)
class Learner:
    """The policy being trained and what steps it: the components the update works with."""

    accelerator: Any
    policy: Any  # TokenLogprobs, as Accelerate prepared it (DDP / DeepSpeed engine / plain)
    optimizer: Any
    scheduler: Any  # stepped by us, not by Accelerate
    heap_trimmer: Callable[[], None]  # called where a phase's peak begins (cpu/heap.py)


@dataclass(frozen=True)
class LossSettings:
    """What a micro-batch's loss reads besides its tensors: the loss type, and the counts its normaliser needs
    (those that depend on the step, its rows and tokens per mini-batch over all ranks, are the `TrainBatch`'s)."""

    variant: losses.LossVariant
    options: losses.LossOptions
    max_completion_length: int
    world: int

    @classmethod
    def of(cls, cfg: Config, geometry: Geometry) -> LossSettings:
        return cls(
            cfg.loss.variant,
            cfg.loss.options,
            cfg.rollout.max_completion_length,
            geometry.world,
        )


@dataclass(frozen=True)
class UpdateSettings:
    loss: LossSettings
    iterations: int  # train.num_iterations
    mini_batches: int
    max_grad_norm: float | None
    max_consecutive_nonfinite: int
    # The engine's log-probs differ from the trainer's (vLLM): the step logs sampling/mismatch_kl where it reports
    # them. Not on hf, whose endpoint log-probs (agents) are the trainer's own weights': its records stay as they were.
    log_mismatch: bool = False

    @classmethod
    def of(cls, cfg: Config, geometry: Geometry) -> UpdateSettings:
        train = cfg.train
        return cls(
            LossSettings.of(cfg, geometry),
            train.num_iterations,
            geometry.mini_batches,
            train.max_grad_norm,
            train.max_consecutive_nonfinite,
            cfg.rollout.sampler_logprobs_differ,
        )


@dataclass(frozen=True)
class LogprobSettings:
    needs_old: bool  # train.policy_moves_within_step: the sampling-time policy differs from the trained one
    top_entropy_quantile: float

    @classmethod
    def of(cls, cfg: Config) -> LogprobSettings:
        return cls(cfg.train.policy_moves_within_step, cfg.loss.top_entropy_quantile)


@torch.no_grad()
def add_logprobs(policy, batch: TrainBatch, terms: tuple[LossTerm, ...], comm, settings: LogprobSettings) -> None:
    """Per micro-batch, before any update: old log-probs (only when the sampling-time policy differs from the
    one being trained by some step: otherwise the old policy *is* the current one), token entropies (only for
    top_entropy_quantile < 1), and each term's annotation (the reference's log-probs, the teacher's)."""
    rho = settings.top_entropy_quantile
    entropies = []
    for mb in batch.micro_batches:
        if batch.idle[mb.mini_batch]:  # fillers only, on every rank: nothing to score
            entropies.append(torch.zeros_like(mb.mask))
            continue
        if settings.needs_old or rho < 1:
            logp, entropy = policy(**mb.sequences, with_entropy=rho < 1)
            mb.old_logp = logp if settings.needs_old else None
            entropies.append(entropy)
        for term in terms:
            annotation = term.annotate(mb)
            if annotation is not None:
                mb.annotations[term.name] = annotation
    if rho < 1:
        batch.metrics.update(
            select_high_entropy_tokens(comm, batch, entropies, rho, per_token_advantages=shapes_advantages(terms))
        )


def select_high_entropy_tokens(
    comm, batch: TrainBatch, entropies: list[torch.Tensor], rho: float, per_token_advantages: bool = False
) -> dict[str, float]:
    """Set each micro-batch's `entropy_mask`: 1 on the top-rho highest-entropy tokens of the whole batch (all
    ranks), ranked among the tokens that can carry policy gradient (kept, of a completion with advantage != 0:
    the same set whether or not zero-advantage completions skip the passes; every kept token where a per-token
    term such as the teacher's joins the advantage). One threshold for the batch, from the sampling-time policy,
    so the selection does not depend on micro-batches, mini-batches or ranks."""
    ranked = [(mb.mask > 0) & ((mb.advantages[:, None] != 0) | per_token_advantages) for mb in batch.micro_batches]
    local = torch.cat([e[r].float().cpu() for e, r in zip(entropies, ranked)] + [torch.zeros(0)])
    everything = gather_ragged(comm, local).double()  # float32 -> float64 is exact: the same threshold as before
    threshold = losses.entropy_threshold(everything, rho)
    for mb, entropy in zip(batch.micro_batches, entropies):
        mb.entropy_mask = (entropy.double() >= threshold).to(mb.mask.dtype)
    if everything.numel() == 0:  # no token had a policy gradient to keep
        return {"entropy/threshold": math.nan, "entropy/masked_fraction": 0.0}
    kept = int((everything >= threshold).sum())
    return {"entropy/threshold": threshold, "entropy/masked_fraction": 1 - kept / everything.numel()}


def gather_ragged(comm, values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values` (of any length), concatenated in rank order: two tensor collectives (the lengths,
    then the values padded to the longest), so a long batch moves as one float tensor, not as pickled objects."""
    counts = comm.gather(torch.tensor([values.numel()]))  # [world]
    padded = torch.zeros(1, int(counts.max()), dtype=values.dtype)
    padded[0, : values.numel()] = values
    rows = comm.gather(padded)  # [world, longest]
    return torch.cat([row[:n] for row, n in zip(rows, counts.tolist())])


# The step's own statistics (the terms add theirs): how each adds up over the passes (terms.Sum).
CORE_SUMS = {
    "loss": Sum.SHARE,  # the batch loss (each micro-batch's share, averaged over the optimizer steps)
    "clip_low": Sum.PASS,  # tokens clipped below / above / either, averaged over iterations
    "clip_high": Sum.PASS,
    "clip_region": Sum.PASS,
    "entropy": Sum.FIRST,  # over trained tokens
    "trained_tokens": Sum.FIRST,
    "logp_gap": Sum.FIRST,  # |trainer - sampler| log-prob over trained tokens (engines that report them)
    "mismatch_kl": Sum.FIRST,  # k3 of the sampler against pi_old over trained tokens (UpdateSettings.log_mismatch)
}


@dataclass
class StepStats:
    """What one step's update did: `sums` of this rank's statistics, the core's (`CORE_SUMS`) and each term's
    (0-d, on the device) until `reduced` adds the ranks together; `metrics` turns them into the logged means,
    asking each of the step's terms for its own."""

    terms: tuple[LossTerm, ...]  # as this step applied them
    sums: dict[str, torch.Tensor]
    logp_gap_max: torch.Tensor  # max of |trainer - sampler| log-prob: reduced with max, not sum
    iterations: int = 1
    steps: int = 1  # optimizer steps: iterations x mini-batches
    grad_norm: float = math.nan  # of the last optimizer step; the same on every rank
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient
    log_mismatch: bool = False  # sampling/mismatch_kl is logged (UpdateSettings.log_mismatch)

    @classmethod
    def zeros(
        cls, device, trained_completions: int, terms: tuple[LossTerm, ...] = (), iterations: int = 1, steps: int = 1
    ) -> StepStats:
        names = [*CORE_SUMS, "trained_completions", *(name for term in terms for name in term.sums)]
        sums = {name: torch.zeros((), device=device) for name in names}
        sums["trained_completions"] += trained_completions
        return cls(terms, sums, torch.zeros((), device=device), iterations, steps)

    def kind(self, name: str) -> Sum:
        if name in CORE_SUMS:
            return CORE_SUMS[name]
        return next(term.sums[name] for term in self.terms if name in term.sums)

    def add(self, parts: Mapping[str, torch.Tensor], iteration: int) -> None:
        """One micro-batch's sums in pass `iteration`, each as its kind adds up."""
        for name, value in parts.items():
            kind = self.kind(name)
            if kind is Sum.SHARE:
                self.sums[name] += value / self.steps
            elif kind is Sum.PASS:
                self.sums[name] += value / self.iterations
            elif iteration == 0:
                self.sums[name] += value

    def reduced(self, comm) -> StepStats:
        """Sums over all ranks (and the max for logp_gap_max)."""
        names = list(self.sums)
        summed = comm.sum(torch.stack([self.sums[n] for n in names]))
        return replace(self, sums=dict(zip(names, summed)), logp_gap_max=comm.max(self.logp_gap_max.reshape(1))[0])

    def metrics(self, total_tokens: float, total_rows: int, sampler_logprobs: bool) -> dict:
        """The logged means; `sampler_logprobs` when the engine reported the sampler's log-probs this step."""
        sums = self.sums
        totals = StepTotals(
            loss=sums["loss"],
            tokens=max(total_tokens, 1),
            trained_tokens=max(float(sums["trained_tokens"]), 1),
            trained_completions=float(sums["trained_completions"]),
            sampler_logprobs=sampler_logprobs,
        )
        tokens, trained = totals.tokens, totals.trained_tokens
        out = {
            "loss": float(sums["loss"]),
            "grad_norm": float(self.grad_norm),
            "nonfinite_skipped": self.nonfinite_skipped,
            "entropy": float(sums["entropy"]) / trained,  # over the completions that were trained on
            "completions/trained_fraction": totals.trained_completions / total_rows,
            "clip_ratio/low_mean": float(sums["clip_low"]) / tokens,
            "clip_ratio/high_mean": float(sums["clip_high"]) / tokens,
            "clip_ratio/region_mean": float(sums["clip_region"]) / tokens,
        }
        if sampler_logprobs:
            out["sampling/logp_diff_mean"] = float(sums["logp_gap"]) / trained
            out["sampling/logp_diff_max"] = float(self.logp_gap_max)
            if self.log_mismatch:
                out["sampling/mismatch_kl"] = float(sums["mismatch_kl"]) / trained
        for term in self.terms:
            out.update(term.metrics(sums, totals))
        return out


def update(
    learner: Learner,
    batch: TrainBatch,
    state: TrainState,
    terms: tuple[LossTerm, ...],
    comm,
    settings: UpdateSettings,
) -> tuple[StepStats, TrainState]:
    """`settings.iterations` passes over the micro-batches, an optimizer step per mini-batch of each pass (the
    micro-batches come ordered by mini-batch, `batch.window_sizes[k]` of them in mini-batch k on every rank), in
    step `state.step`. Returns the step's statistics and the state after it: the non-finite streak, and what the
    terms change (the entropy coefficient where it adapts)."""
    accelerator, step = learner.accelerator, state.step
    iterations = settings.iterations
    steps = iterations * settings.mini_batches  # the logged loss: the mean of the optimizer steps' losses
    terms = tuple(term.for_step(batch, comm, state) for term in terms)
    stats = StepStats.zeros(accelerator.device, batch.trained_completions, terms, iterations, steps)
    stats.log_mismatch = settings.log_mismatch
    # A term that needs H with its gradient needs it in every pass; otherwise H is a first-pass statistic.
    entropy_grad = any(term.needs_entropy_grad for term in terms)
    nonfinite = state.nonfinite_in_a_row
    window_loss = torch.zeros((), device=accelerator.device)  # the loss of the optimizer step being accumulated
    skip_idle = distributed.steps_without_backward(accelerator)
    for iteration in range(iterations):
        for i, mb in enumerate(batch.micro_batches):
            if i == 0 or mb.mini_batch != batch.micro_batches[i - 1].mini_batch:  # an optimizer step begins
                distributed.start_accumulation(accelerator, batch.window_sizes[mb.mini_batch])
                if batch.idle[mb.mini_batch] and skip_idle:
                    nonfinite = _step_on_zero_gradients(learner, settings, stats, step, nonfinite)
            if batch.idle[mb.mini_batch] and skip_idle:
                continue
            with accelerator.accumulate(learner.policy):
                wanted = (
                    {"with_entropy": True, "entropy_grad": True} if entropy_grad else {"with_entropy": iteration == 0}
                )
                learner.heap_trimmer()
                logp, entropy = learner.policy(**mb.sequences, **wanted)
                share, parts = micro_batch_loss(batch, mb, logp, settings.loss, terms, entropy)
                learner.heap_trimmer()
                # The backend divides by the accumulation steps and the ranks' gradients are averaged: undo
                # both, so the shares of all micro-batches on all ranks add up to the batch loss.
                accelerator.backward(share * distributed.backward_divisor(accelerator) * settings.loss.world)
                window_loss = window_loss + share.detach()
                if accelerator.sync_gradients:
                    nonfinite = _optimizer_step(learner, settings, stats, step, window_loss, nonfinite)
                    window_loss = torch.zeros_like(window_loss)
                learner.optimizer.zero_grad(set_to_none=True)
            # Clipping only happens once the policy has moved (a later iteration or mini-batch): averaged over them.
            parts["loss"] = share.detach()
            if iteration == 0:
                parts["entropy"] = (entropy.detach() * mb.mask).sum()
                parts["trained_tokens"] = mb.mask.sum()
                if mb.sampling_logp is not None:
                    gap = (logp.detach() - mb.sampling_logp).abs() * mb.mask
                    parts["logp_gap"] = gap.sum()
                    stats.logp_gap_max = torch.maximum(stats.logp_gap_max, gap.max())
                    if settings.log_mismatch:  # against pi_old: the policy the correction's ratio compares
                        old = mb.old_logp if mb.old_logp is not None else logp.detach()
                        k3 = losses.mismatch_kl(old, mb.sampling_logp)  # [mb, C]; off the mask: anything
                        parts["mismatch_kl"] = torch.where(mb.mask > 0, k3, torch.zeros_like(k3)).sum()
            stats.add(parts, iteration)
    for term in terms:
        state = term.after_step(stats.sums, comm, state)
    return stats, replace(state, nonfinite_in_a_row=nonfinite)


def _step_on_zero_gradients(
    learner: Learner, settings: UpdateSettings, stats: StepStats, step: int, nonfinite_in_a_row: int
) -> int:
    """An optimizer step for a mini-batch no rank trains anything in, without forward or backward passes.

    Its fillers would give every parameter a gradient of exactly 0 and add 0 to every statistic; the step itself
    must still happen (Adam's moments and weight decay move the weights, the schedule advances), so it is taken
    on explicit zero gradients: the same update, without the passes."""
    for parameter in learner.policy.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    zero = torch.zeros((), device=learner.accelerator.device)
    nonfinite_in_a_row = _optimizer_step(learner, settings, stats, step, zero, nonfinite_in_a_row)
    learner.optimizer.zero_grad(set_to_none=True)
    return nonfinite_in_a_row


def micro_batch_loss(
    batch: TrainBatch,
    mb: MicroBatch,
    logp: torch.Tensor,
    settings: LossSettings,
    terms: tuple[LossTerm, ...] = (),
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of its mini-batch's loss (the whole batch's when mini_batches = 1), and its sums:
    the clipping sums of `losses.per_token_loss` and what each term recorded. `terms` are the step's
    (`LossTerm.for_step`), applied in order: advantages shaped, then the policy term weighted, then additions.

    The PPO ratio's "old" policy is the trainer's own at the start of the step (`old_logp`, or the current
    log-probs detached when one optimizer step is taken); the sampler's log-probs enter only through the
    terms (the rollout correction, the off-policy mask). With asynchronous rollouts this is decoupled PPO: the
    sampler is the behaviour policy, K weight versions old (docs/async.md explains the choice)."""
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    behaviour = mb.sampling_logp if mb.sampling_logp is not None else old  # the policy that sampled: pi_old without one
    inputs = TermInputs(
        mb,
        logp,
        old,
        behaviour,
        entropy,
        advantages=mb.advantages[:, None].expand_as(logp),  # [mb, C]: the group's, the same on every token
        sequence_advantages=mb.advantages,
    )
    for term in terms:
        shaped = term.advantage(inputs)
        if shaped is not None:
            inputs.advantages = shaped
            inputs.sequence_advantages = losses.masked_sum(shaped, mb.mask, dim=1) / mb.mask.sum(1).clamp(min=1)
    sampler_weight, policy_weight = None, mb.entropy_mask  # entropy selection weights the policy term only
    for term in terms:
        weight = term.weight(inputs)
        if weight is None:
            continue
        if term.weights_sampler:
            sampler_weight = weight if sampler_weight is None else sampler_weight * weight
        else:
            policy_weight = weight if policy_weight is None else policy_weight * weight
    variant = settings.variant
    token_loss, parts = losses.per_token_loss(
        variant,
        settings.options,
        logp,
        old,
        inputs.advantages,
        mb.mask,
        policy_weight=policy_weight,
        sampler_weight=sampler_weight,
    )
    additions = [addition for addition in (term.add(inputs) for term in terms) if addition is not None]
    for addition in additions:
        if addition.token_loss is not None:
            token_loss = token_loss + addition.token_loss
    share = losses.aggregate(
        token_loss,
        mb.mask,
        variant,
        total_sequences=batch.mini_batch_rows[mb.mini_batch],
        total_tokens=batch.mini_batch_totals[mb.mini_batch],
        max_completion_length=settings.max_completion_length,
        total_micro_batches=batch.window_sizes[mb.mini_batch] * settings.world,
    )
    for addition in additions:
        if addition.share is not None:
            share = share + addition.share
    return share, {**parts, **inputs.sums}


@dataclass(frozen=True)
class ScoreChecks:
    """What `check_scored` compares a step's rewards with."""

    rewards: tuple[Any, ...]  # the task's reward functions (rewards.Reward)
    max_unscored: int  # train.max_consecutive_unscored
    environment: str  # how the warnings name the environment: "environment.factory ...", or "the environment"

    @classmethod
    def of(cls, cfg: Config, rewards) -> ScoreChecks:
        kind = cfg.environment.kind
        name = f"environment.{kind} {getattr(cfg.environment, kind)}" if kind else "the environment"
        return cls(tuple(rewards), cfg.train.max_consecutive_unscored, name)


def check_scored(
    per_function: torch.Tensor, episodes: EpisodeStats, step: int, unscored_in_a_row: int, checks: ScoreChecks
) -> int:
    """Before the update: warn about rewards that scored no completion of the step (None or NaN for every one, over
    all ranks: `per_function` [world * local_n, R]), and count the steps in which none did, or in which the
    environment failed every episode: nothing to learn from (every advantage 0), yet the run would go on silently.
    Returns the count after this step (`unscored_in_a_row` before it; the count is in checkpoints); stops once
    more than train.max_consecutive_unscored such steps came in a row. Every rank sees the gathered rewards and
    episode metrics, so every rank decides alike."""
    from .rewards import unscored

    if episodes.all_failed:
        return _all_episodes_failed(episodes, step, unscored_in_a_row + 1, checks)
    names = unscored(list(checks.rewards), per_function)
    n = per_function.shape[0]
    if len(names) < len(checks.rewards) or not n:
        for name in names:
            logger.warning(
                "step %d: reward '%s' returned None or NaN for all %d completions (the others scored them)",
                step,
                name,
                n,
            )
        return 0
    unscored_in_a_row += 1
    which = ", ".join(f"'{name}'" for name in names)
    limit = checks.max_unscored
    if unscored_in_a_row > limit:
        raise TrainingError(
            f"step {step}: {unscored_in_a_row} steps in a row in which no reward scored any completion "
            f"(reward {which} returned None or NaN for all {n}); stopping (train.max_consecutive_unscored={limit}). "
            "Check the reward on a few completions by hand: does it return a number where it can judge one?"
        )
    logger.warning(
        "step %d: no reward scored any completion (reward %s returned None or NaN for all %d): nothing to "
        "learn from this step (%d in a row; train.max_consecutive_unscored=%d)",
        step,
        which,
        n,
        unscored_in_a_row,
        limit,
    )
    return unscored_in_a_row


def _all_episodes_failed(episodes: EpisodeStats, step: int, in_a_row: int, checks: ScoreChecks) -> int:
    """A step in which the environment failed every episode (all ranks): whatever on_error scores them, nothing
    was learnt about the model. Counted as a step no reward scored (the same limit, the same count in checkpoints):
    warned about with this rank's first error, stopped after train.max_consecutive_unscored in a row."""
    first = f": {episodes.failures[0][0]}" if episodes.failures else ""
    limit = checks.max_unscored
    what = f"{checks.environment} failed every episode{first}"
    if in_a_row > limit:
        raise TrainingError(
            f"step {step}: {in_a_row} steps in a row in which {what}; stopping (train.max_consecutive_unscored={limit})"
        )
    logger.warning(
        "step %d: %s: nothing to learn from this step (%d in a row; train.max_consecutive_unscored=%d)",
        step,
        what,
        in_a_row,
        limit,
    )
    return in_a_row


def _optimizer_step(
    learner: Learner,
    settings: UpdateSettings,
    stats: StepStats,
    step: int,
    window_loss: torch.Tensor,
    nonfinite_in_a_row: int,
) -> int:
    """Clip and step, or skip and count a non-finite update; stop once too many come in a row. Returns the count of
    non-finite updates in a row after this one (`nonfinite_in_a_row` before it)."""
    # The norm is global (reduced over ranks), so every rank takes the same decision.
    grad_norm = distributed.global_grad_norm(learner.accelerator, learner.policy, settings.max_grad_norm)
    stats.grad_norm = grad_norm
    if torch.isfinite(grad_norm):
        learner.heap_trimmer()
        learner.optimizer.step()
        learner.scheduler.step()
        return 0
    nonfinite_in_a_row += 1
    stats.nonfinite_skipped += 1
    loss, limit = float(window_loss), settings.max_consecutive_nonfinite
    if nonfinite_in_a_row > limit:
        raise TrainingError(
            f"step {step}: {nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
            f"(loss {loss}, grad norm {float(grad_norm)}); stopping (train.max_consecutive_nonfinite={limit}). "
            "Lower train.learning_rate, keep train.max_grad_norm set, try model.dtype=float32, and check the rewards."
        )
    logger.warning(
        "step %d: non-finite loss or gradient (loss %s, grad norm %s): optimizer step skipped (%d in a row)",
        step,
        loss,
        float(grad_norm),
        nonfinite_in_a_row,
    )
    return nonfinite_in_a_row
