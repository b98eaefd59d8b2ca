"""The training loop: `train(cfg)` builds the run, resumes it, takes steps, finishes.

One step, as named phases (each a function with a typed input and output):

    1. collect      (collect.py)  prompts -> G completions each -> rewards        -> ScoredBatch
                                  (plain, or DAPO dynamic sampling: same result type); the completions come
                                  from the rollout queue (rollout_queue.py): sampled now, or, with
                                  rollout.max_staleness K >= 1, while the K steps before trained. Its records
                                  (samples.py: TrainingSamples, EpisodeStats, the metrics) are all the phases
                                  below read of what produced the samples
                    engine sleeps (Sleeps)         a sampler that can frees its memory for the update
    2. advantages   (advantages.py) group-relative, over the whole batch (all ranks) -> [rows]
    3. batches      (batches.py)  this rank's completions as micro-batches (CPU): padded or
                                  packed, fixed size or a token budget               -> TrainBatch
    4. log-probs    (update.py)   old (num_iterations or mini_batches > 1), entropy selection
                                  (top_entropy_quantile < 1), the loss terms' annotations (reference,
                                  teacher)                                            -> into the TrainBatch
    5. update       (update.py)   num_iterations x mini-batches x micro-batches: loss with its optional
                                  terms (terms/), backward, a step per mini-batch     -> StepStats
    6. weight sync  (rollout_queue.py) the engine gets the new weights, if it keeps its own copy (after the
                                  generation in flight, K >= 1), and the queue samples the batch K+1 steps ahead
    7. checkpoint   (checkpoint.py) every checkpoint.save_every steps and at the end
    8. report       (report.py)   the record (reduced over ranks) -> metrics.jsonl, trackers, samples, progress
                                  (written by `report` below)
    then: a preemption signal (SIGTERM, SIGUSR1) on any rank stops every rank here, with a checkpoint

What lives for the whole run is one frozen `run.Run` of components, built once by `run.build_run`; what a
step changes and a checkpoint saves is a `TrainState` that each step takes and returns (train_state.py). Only
this loop and the builder take the `Run`: each phase is given the parts it reads (tests/test_phase_inputs.py).
Distribution is Accelerate's: every rank samples its own slice of the prompts,
advantages are computed from the gathered rewards of the whole batch, and the
loss of each micro-batch is scaled so that gradient accumulation and the
cross-rank gradient average add up to exactly the batch loss `losses.aggregate`
defines. The math lives in `losses` and `advantages`; the phases only move data.

Backend-specific plumbing (DeepSpeed, ZeRO-3 gathering, CPU
process groups) lives in `distributed`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import distributed, output_dir
from .advantages import batch_advantages
from .batches import build_train_batch
from .checkpoint import keep_recorded_correction, save_step
from .collect import CollectSettings, Sources, collect
from .config import Config, with_absolute_paths
from .deadline import run_inline
from .errors import UserError
from .evaluate import evaluate_model
from .metrics import PhaseTimer
from .preemption import StopRequests
from .report import completion_samples, step_record, write_completions
from .run import Run, build_run, finish, resume, stop_run
from .samples import ScoredBatch, TrainingSamples
from .terms import term_types
from .trackers import log_samples
from .train_state import TrainState
from .update import Learner, LogprobSettings, ScoreChecks, UpdateSettings, add_logprobs, check_scored, update

logger = logging.getLogger("grpo_trainer")


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    last_metrics: dict
    is_main_process: bool
    preempted_by: str | None = None  # the signal's name when a signal stopped the run (exit code 75)


def train(cfg: Config, on_step_end: Callable[[int], None] | None = None) -> TrainResult:
    """Train as `cfg` says. `on_step_end(step)` is called after every step (a profiler's step(), a test's probe)."""
    cfg = with_absolute_paths(cfg)  # once: user code that calls os.chdir cannot split the run's folders
    is_main = distributed.partial_state().is_main_process
    cfg = keep_recorded_correction(cfg, is_main)  # a resume keeps the loss.tis_cap its checkpoint recorded
    with StopRequests(cfg.checkpoint.save_on_signals) as stop, output_dir.claimed(cfg.output_dir, is_main):
        finished = output_dir.finished_run(cfg, is_main)
        if finished is not None:  # the same command (or notebook cell) run twice: nothing to train
            return TrainResult(Path(cfg.output_dir), 0, finished, is_main)
        run = build_run(cfg)
        try:
            state = resume(run)
            start_step = state.step
            run.rollouts.start(start_step)
            last: dict = {}
            while state.step < cfg.train.max_steps:
                last, state = train_step(run, state, state.step + 1)
                if on_step_end is not None:
                    call_on_step_end(on_step_end, state.step)
                if state.step < cfg.train.max_steps and stop.agreed(run.comm):
                    return preempt(run, state, start_step, last, stop.received)
            finish(run)
        finally:
            run.heap_trimmer.unwatch()  # the model may be the caller's (grpo_trainer.train(model=...)): no hooks left
    return TrainResult(run.output_dir, cfg.train.max_steps - start_step, last, run.is_main_process)


def call_on_step_end(on_step_end: Callable[[int], None], step: int) -> None:
    """The Python API's callback, under the deadline utility's rules but in this thread and with no limit (it is the
    caller's own program, and a profiler's step() must run in the thread it profiles): what it raises reaches the
    caller as it is, except SystemExit, which is an error of the callback (never a silent end of the run)."""
    outcome = run_inline(lambda: on_step_end(step))
    if isinstance(outcome.exception, Exception):
        raise outcome.exception
    if outcome.exception is not None:
        raise UserError(f"on_step_end raised {outcome.error} after step {step}; the run did not finish") from None


def preempt(run: Run, state: TrainState, start_step: int, last: dict, received) -> TrainResult:
    """Stop after `state.step`: its checkpoint (unless one was just saved), writers and engine closed, no final
    model."""
    step = state.step
    if not checkpoint_due(run.cfg, step):
        save_step(run.resumable, state, run.metrics.history_with(None))  # the step's record is in the file already
    stop_run(run)
    name = received.name if received is not None else "a signal on another rank"
    logger.warning(
        "stopped by %s after step %d: checkpoint saved in %s; resume with checkpoint.resume=auto",
        name,
        step,
        run.output_dir / "checkpoints",
    )
    return TrainResult(run.output_dir, step - start_step, last, run.is_main_process, preempted_by=name)


def checkpoint_due(cfg: Config, step: int) -> bool:
    return bool(cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0) or step == cfg.train.max_steps


def train_step(run: Run, state: TrainState, step: int) -> tuple[dict, TrainState]:
    """One GRPO step, phase by phase (see the module docstring), after `state`: its metrics record and the state
    after it."""
    cfg, geometry, started, timer = run.cfg, run.geometry, time.perf_counter(), PhaseTimer()
    run.heap_trimmer()  # what the last step freed, before the rollout's KV cache and reordered weights
    scored = collect(Sources(run.rollouts, run.task, run.comm, geometry, CollectSettings.of(cfg)), step, timer)
    samples = scored.samples  # from here on, the step reads the records of samples.py only
    # a step no reward scored: warned about, stopped after a few in a row
    checks = ScoreChecks.of(cfg, run.task.rewards)
    unscored = check_scored(samples.per_function, scored.episodes, step, state.unscored_in_a_row, checks)
    state = replace(state, step=step, unscored_in_a_row=unscored)
    run.rollouts.before_update()  # a sampler that Sleeps frees its memory for the update
    all_advantages, reward_stats = step_advantages(run, samples)
    reward_stats.update(scored.sampling_stats)  # under dynamic sampling: statistics of everything sampled
    advantages = samples.per_row(geometry.my_completions(all_advantages))  # [rows]: completions, then branches
    with timer.phase("timing/logprobs"):
        batch = build_train_batch(
            samples,
            advantages,
            run.tokenizer.pad_token_id,
            micro_batch_size=geometry.micro_batch_size,
            micro_batch_tokens=geometry.micro_batch_tokens,
            packing=cfg.train.packing,
            mask_truncated=cfg.loss.mask_truncated_completions,
            skip_zero_advantage=skips_zero_advantage(cfg),
            group_size=geometry.group_size,
            mini_batches=geometry.mini_batches,
            comm=run.comm,
        ).to(run.accelerator.device)
        add_logprobs(run.policy, batch, run.terms, run.comm, LogprobSettings.of(cfg))
    with timer.phase("timing/update"):
        learner = Learner(run.accelerator, run.policy, run.optimizer, run.scheduler, run.heap_trimmer)
        stats, state = update(learner, batch, state, run.terms, run.comm, UpdateSettings.of(cfg, geometry))
    with timer.phase("timing/weight_sync"):
        run.rollouts.after_update(step)
    eval_metrics = periodic_eval(run, state, timer)
    record = step_record(
        run.comm,
        step,
        scored,
        reward_stats,
        batch,
        stats.reduced(run.comm),
        run.scheduler.get_last_lr()[0],
        {**eval_metrics, **timer.seconds, **run.rollouts.step_metrics()},
    )
    if run.heap_trimmer.active:
        record["host_memory/trim_seconds"] = run.heap_trimmer.take_seconds()
    record["step_time"] = time.perf_counter() - started
    log_this_step = step % cfg.logging.log_every == 0 or step == cfg.train.max_steps
    if checkpoint_due(cfg, step):
        tick = time.perf_counter()
        save_step(run.resumable, state, run.metrics.history_with(record if log_this_step else None))
        record["timing/checkpoint"] = time.perf_counter() - tick
    report(run, step, record, scored, advantages, log_this_step)
    return record, state


def step_advantages(run: Run, samples: TrainingSamples) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages of the whole batch [world * local_n] (every rank computes them from the gathered rewards) and
    the reward statistics; `loss.reward_aggregation: normalize_then_sum` feeds the per-reward values."""
    loss = run.cfg.loss
    per_function = samples.per_function if loss.reward_aggregation == "normalize_then_sum" else None
    weights = torch.tensor([reward.weight for reward in run.task.rewards])
    advantages, stats = batch_advantages(
        samples.rewards,
        run.geometry.group_size,
        estimator=loss.advantage,
        scale=loss.scale_rewards,
        per_function=per_function,
        weights=weights,
    )
    return advantages, stats


def skips_zero_advantage(cfg: Config) -> bool:
    """Leave zero-advantage completions out of the passes: exact only without a term that acts at a group
    advantage of 0 (KL, entropy, the teacher's: `LossTerm.acts_at_zero_advantage`) and for losses whose normaliser
    does not count the tokens present in a micro-batch (losses.LossVariant)."""
    return (
        cfg.train.skip_zero_advantage
        and not any(term.acts_at_zero_advantage for term in term_types(cfg))
        and cfg.loss.variant.exact_zero_advantage_skip
    )


def periodic_eval(run: Run, state: TrainState, timer: PhaseTimer) -> dict[str, float]:
    """eval/... metrics every eval.every steps (a forked RNG: training's random stream is untouched).

    Every rank evaluates the same prompts with the same seed, in the same full-parameters context as sampling,
    so a sharded model (ZeRO-3) is gathered by all ranks together and every rank makes the same forward calls;
    the ranks would otherwise wait idle for the main process. Where a forward is itself a collective (FSDP) the
    engine runs in lockstep as it does for rollouts: ranks whose kernels round differently may still end their
    completions at different lengths. The main process's results are logged.
    """
    if not (run.cfg.eval.every and state.step % run.cfg.eval.every == 0):
        return {}
    with timer.phase("timing/eval"):
        results = evaluate_model(
            run.bare_lm(),
            run.tokenizer,
            run.cfg,
            task=run.eval_task,
            progress=False,
            full_parameters=lambda _lm: distributed.zero3_sampling_context(run.accelerator, run.policy),
            lockstep=distributed.sampling_lockstep(run.accelerator, run.comm),
            kernel_plan=dict(state.decode_kernels),
        )
    return results if run.is_main_process else {}


def report(
    run: Run, step: int, record: dict, scored: ScoredBatch, advantages: torch.Tensor, log_this_step: bool
) -> None:
    """Phase 8: write the record where it goes (metrics.jsonl, trackers), sample completions when due, advance the
    progress bar."""
    if log_this_step:
        run.metrics.write(record)
        if run.trackers:
            run.accelerator.log(
                {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step
            )
    every = run.cfg.logging.completions_every
    if every and step % every == 0 and run.is_main_process:
        n = min(run.cfg.logging.num_completions, run.geometry.completions_per_rank)
        rewards = run.geometry.my_completions(scored.samples.rewards)
        shown = completion_samples(
            run.task.prompts.texts, run.tokenizer, step, scored.samples, scored.episodes, rewards, advantages, n
        )
        write_completions(run.output_dir / "completions.jsonl", shown, run.cfg.logging.print_completions)
        log_samples(run.accelerator, shown, step)  # as a table, to the trackers that have tables
    run.progress.update(record)
