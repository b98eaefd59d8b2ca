"""Phases 4 and 5: the extra log-prob passes, then `num_iterations` x `mini_batches` optimizer steps -> `StepStats`.

Each micro-batch's loss is scaled so that gradient accumulation (Accelerate
divides by the accumulation steps) and the cross-rank gradient average add up to
exactly the batch loss `losses.aggregate` defines. The math is in `losses`; this
module only runs passes and counts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace

import torch

from . import distributed, losses
from .batches import MicroBatch, TrainBatch
from .errors import TrainingError
from .train_state import TrainState

logger = logging.getLogger("grpo_trainer")


@torch.no_grad()
def add_logprobs(run, batch: TrainBatch) -> None:
    """Per micro-batch, before any update: old log-probs (only when the sampling-time policy differs from the
    one being trained by some step, `train.policy_moves_within_step`: otherwise the old policy *is* the current
    one), token entropies (only for top_entropy_quantile < 1), reference log-probs (only when `loss.kl_on`) and
    the teacher's (only when `loss.teacher_on`)."""
    cfg = run.cfg
    needs_old = cfg.train.policy_moves_within_step
    rho = cfg.loss.top_entropy_quantile
    entropies = []
    for mb in batch.micro_batches:
        if batch.idle[mb.mini_batch]:  # fillers only, on every rank: nothing to score
            entropies.append(torch.zeros_like(mb.mask))
            continue
        if needs_old or rho < 1:
            logp, entropy = run.policy(**mb.sequences, with_entropy=rho < 1)
            mb.old_logp = logp if needs_old else None
            entropies.append(entropy)
        if cfg.loss.kl_on:
            mb.ref_logp = _reference_logprobs(run, mb.sequences)
        if cfg.loss.teacher_on:
            mb.teacher_logp = run.teacher(**mb.sequences)[0]
    if rho < 1:
        batch.metrics.update(
            select_high_entropy_tokens(run.comm, batch, entropies, rho, per_token_advantages=cfg.loss.teacher_on)
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


def _reference_logprobs(run, sequences: dict[str, torch.Tensor]) -> torch.Tensor:
    if run.reference is not None:
        return run.reference(**sequences)[0]
    # LoRA: the reference is the base model itself, adapters switched off; no second copy.
    bare = distributed.unwrap(run.accelerator, run.policy)
    with bare.lm.disable_adapter():
        return bare(**sequences)[0]


@dataclass
class StepStats:
    """What one step's update did. Tensor fields are sums over this rank's tokens (0-d, on the device) until
    `reduced` adds the ranks together; `metrics` turns them into the logged means."""

    loss: torch.Tensor  # the batch loss (each micro-batch's share, averaged over iterations)
    clip_low: torch.Tensor  # tokens clipped below / above / either, averaged over iterations
    clip_high: torch.Tensor
    clip_region: torch.Tensor
    kl: torch.Tensor  # sum of k3 over tokens, averaged over iterations (0 with beta = 0)
    entropy: torch.Tensor  # first iteration, over trained tokens
    entropy_term: torch.Tensor  # c * H, the entropy term's part of `loss` (negated), averaged like it
    term_entropy: torch.Tensor  # first iteration: entropy summed over the tokens the entropy term acts on
    term_tokens: torch.Tensor  # ... and their count (entropy_target is compared with the ratio)
    logp_gap: torch.Tensor  # sum of |trainer - sampler| log-prob over trained tokens (engines that report them)
    logp_gap_max: torch.Tensor  # max of the same: reduced with max, not sum
    is_capped: torch.Tensor  # trained tokens whose rollout-correction ratio left [tis_min, tis_cap] (first iteration)
    off_policy_masked: torch.Tensor  # completions off-policy sequence masking left out (first iteration)
    teacher_kl: torch.Tensor  # first iteration: sum over trained tokens of log mu - log pi_teacher (loss.teacher_kl)
    teacher_term: torch.Tensor  # ... of |the teacher's advantage term|
    group_term: torch.Tensor  # ... of |the group advantage| (the two sizes give the teacher's share)
    trained_tokens: torch.Tensor
    trained_completions: torch.Tensor
    grad_norm: float = math.nan  # of the last optimizer step; the same on every rank
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient
    entropy_coef: float = math.nan  # the entropy term's coefficient this step (NaN: the loss has no entropy term)

    @classmethod
    def zeros(cls, device, trained_completions: int) -> StepStats:
        tensors = {f.name: torch.zeros((), device=device) for f in fields(cls) if f.type == "torch.Tensor"}
        tensors["trained_completions"] += trained_completions
        return cls(**tensors)

    def reduced(self, comm) -> StepStats:
        """Sums over all ranks (and the max for logp_gap_max)."""
        names = [f.name for f in fields(self) if f.type == "torch.Tensor" and f.name != "logp_gap_max"]
        sums = comm.sum(torch.stack([getattr(self, n) for n in names]))
        return replace(self, **dict(zip(names, sums)), logp_gap_max=comm.max(self.logp_gap_max.reshape(1))[0])

    def metrics(
        self,
        total_tokens: float,
        total_completions: int,
        with_kl: bool,
        with_sampler_gap: bool,
        tis_mode: str | None = None,
        off_policy_masking: bool = False,
        with_teacher: bool = False,
    ) -> dict:
        """The logged means; `tis_mode` when rollout correction was applied (names the capped-fraction metric),
        `off_policy_masking` when loss.off_policy_mask_threshold is set, `with_teacher` under loss.teacher_kl."""
        tokens, trained = max(total_tokens, 1), max(float(self.trained_tokens), 1)
        out = {
            "loss": float(self.loss),
            "grad_norm": float(self.grad_norm),
            "nonfinite_skipped": self.nonfinite_skipped,
            "entropy": float(self.entropy) / trained,  # over the completions that were trained on
            "completions/trained_fraction": float(self.trained_completions) / total_completions,
            "clip_ratio/low_mean": float(self.clip_low) / tokens,
            "clip_ratio/high_mean": float(self.clip_high) / tokens,
            "clip_ratio/region_mean": float(self.clip_region) / tokens,
        }
        if not math.isnan(self.entropy_coef):  # names as TRL logs them, plus what entropy_target is compared with
            out["entropy_coef"] = self.entropy_coef
            out["policy_loss"] = float(self.loss) + float(self.entropy_term)  # the loss without -c * H
            out["entropy/term_mean"] = float(self.term_entropy) / max(float(self.term_tokens), 1)
        if with_kl:
            out["kl"] = float(self.kl) / tokens
        if with_sampler_gap:
            out["sampling/logp_diff_mean"] = float(self.logp_gap) / trained
            out["sampling/logp_diff_max"] = float(self.logp_gap_max)
        if tis_mode is not None:
            out[f"sampling/is_{'masked' if tis_mode.endswith('mask') else 'truncated'}_fraction"] = (
                float(self.is_capped) / trained
            )
        if with_teacher:  # the sampled per-token reverse KL(mu || teacher), and the teacher term's part of |A|
            out["teacher/reverse_kl"] = float(self.teacher_kl) / trained
            out["teacher/advantage_share"] = float(self.teacher_term) / max(
                float(self.teacher_term + self.group_term), 1e-30
            )
        if off_policy_masking:
            out["sampling/off_policy_masked_fraction"] = float(self.off_policy_masked) / max(
                float(self.trained_completions), 1
            )
        return out


def update(run, batch: TrainBatch, state: TrainState) -> tuple[StepStats, TrainState]:
    """`train.num_iterations` passes over the micro-batches, an optimizer step per mini-batch of each pass (the
    micro-batches come ordered by mini-batch, `batch.window_sizes[k]` of them in mini-batch k on every rank), in
    step `state.step`. Returns the step's statistics and the state after it: the non-finite streak, and the
    entropy coefficient where it adapts."""
    cfg, geometry, accelerator, step = run.cfg, run.geometry, run.accelerator, state.step
    iterations = cfg.train.num_iterations
    steps = iterations * geometry.mini_batches  # the logged loss: the mean of the optimizer steps' losses
    stats = StepStats.zeros(accelerator.device, batch.trained_completions)
    term = EntropyTerm.for_step(run, batch, state.entropy_control) if cfg.loss.entropy_term else None
    nonfinite = state.nonfinite_in_a_row
    window_loss = torch.zeros((), device=accelerator.device)  # the loss of the optimizer step being accumulated
    skip_idle = distributed.steps_without_backward(accelerator)
    for iteration in range(iterations):
        for i, mb in enumerate(batch.micro_batches):
            if i == 0 or mb.mini_batch != batch.micro_batches[i - 1].mini_batch:  # an optimizer step begins
                distributed.start_accumulation(accelerator, batch.window_sizes[mb.mini_batch])
                if batch.idle[mb.mini_batch] and skip_idle:
                    nonfinite = _step_on_zero_gradients(run, stats, step, nonfinite)
            if batch.idle[mb.mini_batch] and skip_idle:
                continue
            with accelerator.accumulate(run.policy):
                # The entropy term needs H with its gradient in every pass; otherwise H is a first-pass statistic.
                wanted = {"with_entropy": iteration == 0}
                if term is not None:
                    wanted = {"with_entropy": True, "entropy_grad": True}
                run.heap_trimmer()
                logp, entropy = run.policy(**mb.sequences, **wanted)
                share, parts = micro_batch_loss(run, batch, mb, logp, entropy, term)
                run.heap_trimmer()
                # The backend divides by the accumulation steps and the ranks' gradients are averaged: undo
                # both, so the shares of all micro-batches on all ranks add up to the batch loss.
                accelerator.backward(share * distributed.backward_divisor(accelerator) * geometry.world)
                window_loss = window_loss + share.detach()
                if accelerator.sync_gradients:
                    nonfinite = _optimizer_step(run, stats, step, window_loss, nonfinite)
                    window_loss = torch.zeros_like(window_loss)
                run.optimizer.zero_grad(set_to_none=True)
            # Averaged over iterations: clipping only happens once the policy has moved (a later iteration or
            # mini-batch). Clip and KL sums cover every token once per pass.
            stats.loss += share.detach() / steps
            stats.clip_low += parts["clip_low"] / iterations
            stats.clip_high += parts["clip_high"] / iterations
            stats.clip_region += parts["clip_region"] / iterations
            stats.kl += torch.as_tensor(parts.get("kl", 0.0), device=stats.kl.device) / iterations
            if term is not None:
                stats.entropy_term += parts["entropy_term"] / steps
            if iteration == 0:
                stats.is_capped += parts.get("is_capped", 0.0)
                stats.off_policy_masked += parts.get("off_policy_masked", 0.0)
                stats.teacher_kl += parts.get("teacher_kl", 0.0)
                stats.teacher_term += parts.get("teacher_term", 0.0)
                stats.group_term += parts.get("group_term", 0.0)
                stats.entropy += (entropy.detach() * mb.mask).sum()
                stats.trained_tokens += mb.mask.sum()
                if term is not None:
                    stats.term_entropy += (entropy.detach() * term.mask(mb)).sum()
                    stats.term_tokens += term.mask(mb).sum()
                if mb.sampling_logp is not None:
                    gap = (logp.detach() - mb.sampling_logp).abs() * mb.mask
                    stats.logp_gap += gap.sum()
                    stats.logp_gap_max = torch.maximum(stats.logp_gap_max, gap.max())
    control = state.entropy_control
    if term is not None:
        stats.entropy_coef = term.coef
        control = term.adapt(run, stats, control)
    return stats, replace(state, nonfinite_in_a_row=nonfinite, entropy_control=control)


def _step_on_zero_gradients(run, stats: StepStats, step: int, nonfinite_in_a_row: int) -> int:
    """An optimizer step for a mini-batch no rank trains anything in, without forward or backward passes.

    Its fillers would give every parameter a gradient of exactly 0 and add 0 to every statistic; the step itself
    must still happen (Adam's moments and weight decay move the weights, the schedule advances), so it is taken
    on explicit zero gradients: the same update, without the passes."""
    for parameter in run.policy.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    nonfinite_in_a_row = _optimizer_step(
        run, stats, step, torch.zeros((), device=run.accelerator.device), nonfinite_in_a_row
    )
    run.optimizer.zero_grad(set_to_none=True)
    return nonfinite_in_a_row


def micro_batch_loss(
    run,
    batch: TrainBatch,
    mb: MicroBatch,
    logp: torch.Tensor,
    entropy: torch.Tensor | None = None,
    term: EntropyTerm | None = None,
) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of its mini-batch's loss (the whole batch's when mini_batches = 1), and the
    clipping/KL sums of `losses.per_token_loss` (plus `is_capped`, tokens outside the rollout-correction range,
    `off_policy_masked`, completions off-policy sequence masking left out, and `entropy_term`, c times this share
    of H, when the loss has an entropy term: `entropy` then carries its gradient).

    The PPO ratio's "old" policy is the trainer's own at the start of the step (`old_logp`, or the current
    log-probs detached when one optimizer step is taken); the sampler's log-probs enter only through the
    rollout correction and the off-policy masks. With asynchronous rollouts this is decoupled PPO: the sampler
    is the behaviour policy, K weight versions old (docs/async.md explains the choice)."""
    cfg, geometry = run.cfg, run.geometry
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    behaviour = mb.sampling_logp if mb.sampling_logp is not None else old  # the policy that sampled: pi_old without one
    advantages = mb.advantages[:, None].expand_as(logp)  # [mb, C]: the group's, the same on every token
    sequence_advantages = mb.advantages
    teacher_parts = {}
    if cfg.loss.teacher_on:
        teacher = losses.teacher_advantage(mb.teacher_logp, behaviour, mb.mask, cfg.loss.teacher_kl)
        advantages = advantages + teacher
        sequence_advantages = losses.masked_sum(advantages, mb.mask, dim=1) / mb.mask.sum(1).clamp(min=1)
        teacher_parts = {  # first-pass statistics: the sampled reverse KL, and the two terms' sizes
            "teacher_kl": losses.masked_sum(behaviour - mb.teacher_logp, mb.mask),
            "teacher_term": losses.masked_sum(teacher.abs(), mb.mask),
            "group_term": losses.masked_sum(mb.advantages[:, None].abs().expand_as(logp), mb.mask),
        }
    correction, capped, gate, masked_sequences = None, None, mb.entropy_mask, None
    if mb.sampling_logp is not None and cfg.loss.correction_on:
        correction, capped = losses.importance_weight(
            old, mb.sampling_logp, mb.mask, cfg.loss.tis_cap, cfg.loss.tis_mode, floor=cfg.loss.tis_min
        )
    if cfg.loss.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: against the sampler
        keep = losses.off_policy_sequence_mask(
            logp, behaviour, sequence_advantages, mb.mask, cfg.loss.off_policy_mask_threshold
        )
        masked_sequences = ((1 - keep[:, 0]) * (mb.mask.sum(1) > 0)).sum()  # real completions only
        gate = keep if gate is None else gate * keep
    variant = cfg.loss.variant
    token_loss, parts = losses.per_token_loss(
        variant,
        cfg.loss.options,
        logp,
        old,
        advantages,
        mb.mask,
        ref_logp=mb.ref_logp,
        beta=cfg.loss.beta,
        policy_weight=gate,  # entropy selection, off-policy masking: like the correction, the policy term only
        sampler_weight=correction,
    )
    if capped is not None:
        parts["is_capped"] = losses.masked_sum(capped.float(), mb.mask)
    if masked_sequences is not None:
        parts["off_policy_masked"] = masked_sequences
    parts.update(teacher_parts)
    share = losses.aggregate(
        token_loss,
        mb.mask,
        variant,
        total_sequences=geometry.total_completions // geometry.mini_batches,
        total_tokens=batch.mini_batch_totals[mb.mini_batch],
        max_completion_length=cfg.rollout.max_completion_length,
        total_micro_batches=batch.window_sizes[mb.mini_batch] * geometry.world,
    )
    if term is not None:  # L - c * H
        bonus = term.coef * losses.entropy_share(entropy, term.mask(mb), term.tokens[mb.mini_batch])
        share = share - bonus
        parts["entropy_term"] = bonus.detach()
    return share, parts


@dataclass
class EntropyTerm:
    """The entropy term of one step: its coefficient (from the state's `entropy_control`, fixed for the whole step) and,
    per mini-batch, how many tokens it averages over on all ranks (H's denominator, so the micro-batches'
    shares add up to H whatever the split)."""

    coef: float
    tokens: list[float]

    @staticmethod
    def mask(mb: MicroBatch) -> torch.Tensor:
        """The tokens the term acts on: the trained ones, or the top-entropy ones that carry policy gradient under
        top_entropy_quantile (the same set as the policy term, as TRL does)."""
        return mb.mask if mb.entropy_mask is None else mb.mask * mb.entropy_mask

    @classmethod
    def for_step(cls, run, batch: TrainBatch, control: losses.EntropyControl) -> EntropyTerm:
        local = torch.zeros(run.geometry.mini_batches, dtype=torch.float64)
        for mb in batch.micro_batches:
            local[mb.mini_batch] += float(cls.mask(mb).sum())
        return cls(coef=control.applied, tokens=[float(t) for t in run.comm.sum(local)])

    def adapt(self, run, stats: StepStats, control: losses.EntropyControl) -> losses.EntropyControl:
        """Adaptive control (loss.entropy_target): the next step's coefficient from this step's mean entropy over
        the term's tokens, all ranks (first pass: the sampling-time policy when mini_batches = 1); `control`
        unchanged where the coefficient is fixed."""
        loss = run.cfg.loss
        if loss.entropy_target is None:
            return control
        measured = run.comm.sum(torch.stack([stats.term_entropy, stats.term_tokens]).double())
        entropy, tokens = float(measured[0]), float(measured[1])
        mean = entropy / tokens if tokens > 0 else math.nan
        return control.after_step(
            mean,
            target=loss.entropy_target,
            delta=loss.entropy_coef_delta,
            low=loss.entropy_coef_min,
            high=loss.entropy_coef_max,
        )


def check_scored(run, scored, step: int, unscored_in_a_row: int) -> int:
    """Before the update: warn about rewards that scored no completion of the step (None or NaN for every one, over
    all ranks), and count the steps in which none did: nothing to learn from (every advantage 0), yet the run
    would go on silently. Returns the count after this step (`unscored_in_a_row` before it; the count is in
    checkpoints); stops once more than train.max_consecutive_unscored such steps came in a row. Every rank sees
    the gathered rewards, so every rank decides alike."""
    from .rewards import unscored

    if scored.tool_metrics.get("environment/frac_failed") == 1.0:  # over all ranks
        return _all_episodes_failed(run, scored, step, unscored_in_a_row + 1)
    if scored.per_function is None:
        return unscored_in_a_row
    names = unscored(run.task.rewards, scored.per_function)
    n = scored.per_function.shape[0]
    if len(names) < len(run.task.rewards) or not n:
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
    limit = run.cfg.train.max_consecutive_unscored
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


def _all_episodes_failed(run, scored, step: int, in_a_row: int) -> int:
    """A step in which the environment failed every episode (all ranks): whatever on_error scores them, nothing
    was learnt about the model. Counted as a step no reward scored (the same limit, the same count in checkpoints):
    warned about with this rank's first error, stopped after train.max_consecutive_unscored in a row."""
    from .environments.scoring import failure_kinds

    kinds = failure_kinds(scored.rollout.episodes or [])
    first = f": {kinds[0][0]}" if kinds else ""
    kind = run.cfg.environment.kind
    name = f"environment.{kind} {getattr(run.cfg.environment, kind)}" if kind else "the environment"
    limit = run.cfg.train.max_consecutive_unscored
    what = f"{name} failed every episode{first}"
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


def _optimizer_step(run, stats: StepStats, step: int, window_loss: torch.Tensor, nonfinite_in_a_row: int) -> int:
    """Clip and step, or skip and count a non-finite update; stop once too many come in a row. Returns the count of
    non-finite updates in a row after this one (`nonfinite_in_a_row` before it)."""
    # The norm is global (reduced over ranks), so every rank takes the same decision.
    grad_norm = distributed.global_grad_norm(run.accelerator, run.policy, run.cfg.train.max_grad_norm)
    stats.grad_norm = grad_norm
    if torch.isfinite(grad_norm):
        run.heap_trimmer()
        run.optimizer.step()
        run.scheduler.step()
        return 0
    nonfinite_in_a_row += 1
    stats.nonfinite_skipped += 1
    loss, limit = float(window_loss), run.cfg.train.max_consecutive_nonfinite
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
