"""Phases 4 and 5: the extra log-prob passes, then `num_iterations` optimizer steps -> `StepStats`.

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

logger = logging.getLogger("grpo_trainer")


@torch.no_grad()
def add_logprobs(run, batch: TrainBatch) -> None:
    """Old log-probs (only when a batch is reused: with mu = 1 the old policy *is* the current one) and
    reference log-probs (only when beta > 0), per micro-batch."""
    for mb in batch.micro_batches:
        if run.cfg.train.num_iterations > 1:
            mb.old_logp, _ = run.policy(**mb.sequences)
        if run.cfg.loss.beta > 0:
            mb.ref_logp = _reference_logprobs(run, mb.sequences)


def _reference_logprobs(run, sequences: dict[str, torch.Tensor]) -> torch.Tensor:
    if run.reference is not None:
        return run.reference(**sequences)[0]
    # LoRA: the reference is the base model itself, adapters switched off; no second copy.
    bare = run.accelerator.unwrap_model(run.policy)
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
    logp_gap: torch.Tensor  # sum of |trainer - sampler| log-prob over trained tokens (engines that report them)
    logp_gap_max: torch.Tensor  # max of the same: reduced with max, not sum
    trained_tokens: torch.Tensor
    trained_completions: torch.Tensor
    grad_norm: float = math.nan  # of the last optimizer step; the same on every rank
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient

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

    def metrics(self, total_tokens: float, total_completions: int, with_kl: bool, with_sampler_gap: bool) -> dict:
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
        if with_kl:
            out["kl"] = float(self.kl) / tokens
        if with_sampler_gap:
            out["sampling/logp_diff_mean"] = float(self.logp_gap) / trained
            out["sampling/logp_diff_max"] = float(self.logp_gap_max)
        return out


def update(run, batch: TrainBatch, step: int) -> StepStats:
    """`train.num_iterations` passes over the micro-batches, an optimizer step per pass."""
    cfg, geometry, accelerator = run.cfg, run.geometry, run.accelerator
    iterations = cfg.train.num_iterations
    stats = StepStats.zeros(accelerator.device, batch.trained_completions)
    window_loss = torch.zeros((), device=accelerator.device)  # the loss of the optimizer step being accumulated
    for iteration in range(iterations):
        for mb in batch.micro_batches:
            with accelerator.accumulate(run.policy):
                logp, entropy = run.policy(**mb.sequences, with_entropy=iteration == 0)
                share, parts = micro_batch_loss(run, batch, mb, logp)
                # Accelerate divides by the accumulation steps and the ranks' gradients are averaged: undo
                # both, so the shares of all micro-batches on all ranks add up to the batch loss.
                accelerator.backward(share * geometry.micro_batches * geometry.world)
                window_loss = window_loss + share.detach()
                if accelerator.sync_gradients:
                    _optimizer_step(run, stats, step, window_loss)
                    window_loss = torch.zeros_like(window_loss)
                run.optimizer.zero_grad(set_to_none=True)
            # Averaged over iterations: clipping only happens once the batch is reused (iteration > 0).
            stats.loss += share.detach() / iterations
            stats.clip_low += parts["clip_low"] / iterations
            stats.clip_high += parts["clip_high"] / iterations
            stats.clip_region += parts["clip_region"] / iterations
            stats.kl += torch.as_tensor(parts.get("kl", 0.0), device=stats.kl.device) / iterations
            if iteration == 0:
                stats.entropy += (entropy * mb.mask).sum()
                stats.trained_tokens += mb.mask.sum()
                if mb.sampling_logp is not None:
                    gap = (logp.detach() - mb.sampling_logp).abs() * mb.mask
                    stats.logp_gap += gap.sum()
                    stats.logp_gap_max = torch.maximum(stats.logp_gap_max, gap.max())
    return stats


def micro_batch_loss(run, batch: TrainBatch, mb: MicroBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the batch loss, and the clipping/KL sums of `losses.token_loss`."""
    cfg = run.cfg
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    weight = None
    if mb.sampling_logp is not None and cfg.loss.tis_cap is not None:
        weight = losses.truncated_importance_weight(old, mb.sampling_logp, cfg.loss.tis_cap)
    token_loss, parts = losses.token_loss(
        logp, old, mb.advantages, mb.mask, cfg.loss.type,
        epsilon_low=cfg.loss.epsilon_low, epsilon_high=cfg.loss.epsilon_high_value, delta=cfg.loss.delta,
        ref_logp=mb.ref_logp, beta=cfg.loss.beta, policy_weight=weight,
    )
    share = losses.aggregate(
        token_loss, mb.mask, cfg.loss.type,
        total_sequences=run.geometry.total_completions,
        total_tokens=batch.total_tokens,
        max_completion_length=cfg.rollout.max_completion_length,
        total_micro_batches=len(batch.micro_batches) * run.geometry.world,
    )
    return share, parts


def _optimizer_step(run, stats: StepStats, step: int, window_loss: torch.Tensor) -> None:
    """Clip and step, or skip and count a non-finite update; stop once too many come in a row."""
    # The norm is global (reduced over ranks), so every rank takes the same decision.
    grad_norm = distributed.global_grad_norm(run.accelerator, run.policy, run.cfg.train.max_grad_norm)
    stats.grad_norm = grad_norm
    if torch.isfinite(grad_norm):
        run.optimizer.step()
        run.scheduler.step()
        run.nonfinite_in_a_row = 0
        return
    run.nonfinite_in_a_row += 1
    stats.nonfinite_skipped += 1
    loss, limit = float(window_loss), run.cfg.train.max_consecutive_nonfinite
    if run.nonfinite_in_a_row > limit:
        raise TrainingError(
            f"step {step}: {run.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
            f"(loss {loss}, grad norm {float(grad_norm)}); stopping (train.max_consecutive_nonfinite={limit}). "
            "Lower train.learning_rate, keep train.max_grad_norm set, try model.dtype=float32, and check the rewards."
        )
    logger.warning(
        "step %d: non-finite loss or gradient (loss %s, grad norm %s): optimizer step skipped (%d in a row)",
        step, loss, float(grad_norm), run.nonfinite_in_a_row,
    )
