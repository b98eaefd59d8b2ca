"""The training loop: `train(cfg)` reads top to bottom, one GRPO step at a time.

    prompts -> G completions each -> rewards -> group advantages
      -> (old log-probs if num_iterations > 1, reference log-probs if beta > 0)
      -> num_iterations x micro-batches: loss -> backward -> optimizer step
      -> metrics -> checkpoint

Distribution is Accelerate's: every rank samples its own slice of the prompts,
advantages are computed from the gathered rewards of the whole batch, and the
loss of each micro-batch is scaled so that gradient accumulation and the
cross-rank gradient average add up to exactly the batch loss `losses.aggregate`
defines. The math lives in `losses` and `advantages`; this file only moves data.

Deliberately simple: no sample packing; evaluation during training runs on the main process only.
Backend-specific plumbing (DeepSpeed, ZeRO-3 gathering, CPU process groups) lives in `distributed`.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import distributed, losses
from .advantages import group_advantages
from .config import Config
from .data import PromptSampler, build_prompt_set, is_conversational, load_records
from .errors import ConfigError, TrainingError
from .evaluate import evaluate_model, prepare_eval_data
from .metrics import MetricsWriter
from .models import TokenLogprobs, context_length, eos_token_ids, is_lora, load_causal_lm, load_tokenizer, make_sequence_batch, plain_model
from .rewards import compute_rewards, load_rewards, reward_statistics
from .rollout import Rollout, build_engine

logger = logging.getLogger("grpo_trainer")


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    last_metrics: dict
    is_main_process: bool


def train(cfg: Config, on_step_end: Callable[[int], None] | None = None) -> TrainResult:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from transformers import get_scheduler

    output_dir = Path(cfg.output_dir)
    # The world size is needed before the Accelerator exists (it fixes gradient accumulation). Pass the
    # CPU flag as the Accelerator would: a PartialState made without it pins a multi-process CPU run to one rank.
    world = distributed.partial_state().num_processes
    g = cfg.rollout.num_generations
    local_prompts, grad_accum = _batch_geometry(cfg, world)
    local_n = local_prompts * g  # completions on this rank per step
    trackers = [t for t in cfg.logging.report_to if t != "jsonl"]  # jsonl is ours, always on
    accelerator = Accelerator(
        gradient_accumulation_steps=grad_accum,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "trackers")),
    )
    rank = accelerator.process_index
    _setup_logging(cfg, accelerator.is_main_process)
    distributed.check_distributed_setup(accelerator)
    logger.info(
        "world_size=%d distributed_type=%s device=%s prompts_per_rank=%d completions_per_rank=%d grad_accum=%d",
        world, accelerator.distributed_type.value, accelerator.device, local_prompts, local_n, grad_accum,
    )

    # ---- data, models, optimizer (identical on every rank: same seed before any random init)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    lm = load_causal_lm(cfg.model)
    records = load_records(cfg.data)
    prompt_set = build_prompt_set(cfg.data, tokenizer, records, context_length(lm))
    conversational = is_conversational(records, cfg.data.prompt_column)
    rewards = load_rewards(cfg.rewards)
    if cfg.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = TokenLogprobs(lm, cfg.rollout.temperature, cfg.model.logprob_chunk_size, cfg.model.share_prompt)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=cfg.train.learning_rate,
        betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
        weight_decay=cfg.train.weight_decay,
    )
    optimizer_steps = cfg.train.max_steps * cfg.train.num_iterations
    scheduler = get_scheduler(
        "constant_with_warmup" if cfg.train.lr_scheduler == "constant" else cfg.train.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.train.warmup_steps,
        num_training_steps=optimizer_steps,
    )
    distributed.fill_deepspeed_config(accelerator, cfg)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    # The scheduler stays unprepared: Accelerate's wrapper would step it once per process.
    accelerator.register_for_checkpointing(scheduler)
    reference = None  # with beta = 0 no reference model exists at all
    if cfg.loss.beta > 0 and not is_lora(lm):
        reference = TokenLogprobs(
            load_causal_lm(cfg.model), cfg.rollout.temperature, cfg.model.logprob_chunk_size, cfg.model.share_prompt
        )
        reference = reference.to(accelerator.device).eval().requires_grad_(False)

    def reference_logprobs(sequences: dict[str, torch.Tensor]) -> torch.Tensor:
        if reference is not None:
            return reference(**sequences)[0]
        # LoRA: the reference is the base model itself, adapters switched off; no second copy.
        bare = accelerator.unwrap_model(policy)
        with bare.lm.disable_adapter():
            return bare(**sequences)[0]

    engine = build_engine(
        cfg.rollout.engine,
        get_model=lambda: accelerator.unwrap_model(policy).lm,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=eos_token_ids(tokenizer, lm),
        max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        batch_size=cfg.rollout.batch_size,
        full_parameters=lambda _lm: distributed.zero3_sampling_context(accelerator, policy),
        **(
            _vllm_engine_kwargs(cfg, accelerator)
            if cfg.rollout.engine.startswith("vllm")
            else {"share_prompt": cfg.model.share_prompt}
        ),
    )
    set_seed(cfg.seed + rank)  # from here on, ranks sample different completions

    # ---- resume
    sampler = PromptSampler(len(prompt_set), seed=cfg.seed, shuffle=cfg.data.shuffle)
    start_step = 0
    nonfinite_in_a_row = 0  # optimizer steps skipped in a row for a NaN/inf loss or gradient
    resume_from = _find_checkpoint(cfg)
    metrics_out = MetricsWriter(output_dir, enabled=accelerator.is_main_process)
    if resume_from is not None:
        saved = ckpt.read_trainer_state(resume_from)
        for note, harmless in ckpt.check_resume_compatible(
            saved.get("config", {}), cfg.model_dump(mode="json"), saved.get("world_size"), world, cfg.checkpoint.force_resume
        ):
            (logger.info if harmless else logger.warning)("changed on resume: %s", note)
        ckpt.load_checkpoint(accelerator, resume_from)
        sampler.load_state_dict(saved["sampler"])
        start_step = int(saved["step"])
        nonfinite_in_a_row = int(saved.get("nonfinite_in_a_row", 0))
        metrics_out.restore((resume_from / ckpt.METRICS_HISTORY).read_text())
        logger.info("resumed from %s at step %d", resume_from, start_step)
    else:
        if accelerator.is_main_process and ckpt.complete_checkpoints(output_dir):
            logger.warning("starting over in %s (checkpoint.resume=%s): its metrics and checkpoints will be overwritten",
                           output_dir, cfg.checkpoint.resume)
        metrics_out.restore("")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(cfg.to_yaml())
        ckpt.remove_incomplete(output_dir)
    if trackers:
        accelerator.init_trackers(cfg.logging.project, config=_flat_hparams(cfg))
    eval_data = None
    if cfg.eval.every and accelerator.is_main_process:  # evaluation runs on the main process only
        eval_data = prepare_eval_data(cfg, tokenizer, context_length(lm))
    progress = _progress_bar(cfg, accelerator.is_main_process, start_step)

    last: dict = {}
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        step_start = time.perf_counter()
        timing = PhaseTimer()

        # ---- 1-2. sample G completions per prompt, score them; advantages over the whole batch (all ranks)
        draws = itertools.count()  # sampling rounds this step (dynamic sampling may take several)

        def sample_and_score(local_indices: list[int]):
            timing.start("timing/rollout")
            seeds = None
            if cfg.rollout.seed_per_prompt:  # a function of (seed, step, round, position in the global batch)
                draw = next(draws)
                seeds = [_mix_seed(cfg.seed, step, draw, rank * local_prompts + j) for j in range(len(local_indices))]
            rollout = engine.generate([prompt_set.token_ids[i] for i in local_indices], g, seeds=seeds)
            timing.stop("timing/rollout")
            timing.start("timing/reward")
            rows = [i for i in local_indices for _ in range(g)]  # prompt index of each completion
            texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            reward_batch = compute_rewards(
                rewards,
                prompts=[records[i][cfg.data.prompt_column] for i in rows],
                completions=[[{"role": "assistant", "content": t}] for t in texts] if conversational else texts,
                completion_ids=rollout.completion_ids,
                columns=prompt_set.reward_columns(rows, cfg.data.answer_column),
            )
            timing.stop("timing/reward")
            return rollout, reward_batch

        def next_local_indices() -> list[int]:
            batch_indices = sampler.next_indices(cfg.train.prompts_per_step)
            return batch_indices[rank * local_prompts : (rank + 1) * local_prompts]

        sampling_stats: dict[str, float] = {}
        if cfg.loss.dynamic_sampling:
            local_indices, rollout, all_rewards, reward_metrics, sampling_stats = _dynamic_sampling(
                accelerator, sample_and_score, next_local_indices, cfg, local_prompts
            )
        else:
            local_indices = next_local_indices()
            rollout, reward_batch = sample_and_score(local_indices)
            all_rewards = accelerator.gather(reward_batch.total.to(accelerator.device)).cpu()  # [world * local_n]
            # Mean/std of each reward over all ranks; counters and seconds stay the main process's own.
            all_per_function = accelerator.gather(reward_batch.per_function.to(accelerator.device)).cpu()  # [world * local_n, R]
            reward_metrics = {**reward_batch.metrics, **reward_statistics(rewards, all_per_function)}
        rows = [i for i in local_indices for _ in range(g)]
        all_advantages, reward_stats = group_advantages(all_rewards, g, cfg.loss.scale_rewards)
        reward_stats.update(sampling_stats)  # under dynamic sampling: statistics of everything sampled
        advantages = all_advantages[rank * local_n : (rank + 1) * local_n]  # [local_n]

        # ---- 3. micro-batches; old and reference log-probs only when needed
        timing.start("timing/logprobs")
        lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
        keep = torch.ones(local_n)
        if cfg.loss.mask_truncated_completions:
            keep = 1.0 - torch.tensor(rollout.truncated, dtype=torch.float32)
        # Completions that cannot move the weights stay out of the passes (exact: see _micro_batch_rows).
        skip_zero = cfg.train.skip_zero_advantage and cfg.loss.beta == 0 and cfg.loss.type != "bnpo"
        trainable = None  # None: every completion
        row_weight = keep  # per completion: 0 masks all its tokens out of the loss and the metrics
        if skip_zero:
            trainable = [j for j in range(local_n) if advantages[j] != 0 and keep[j] > 0 and lengths[j] > 0]
            row_weight = torch.zeros(local_n).index_fill_(0, torch.tensor(trainable, dtype=torch.long), 1.0)
        micro_batches = []
        for idx in _micro_batch_rows(local_n, cfg.train.micro_batch_size, trainable, lengths):
            batch = make_sequence_batch(
                [prompt_set.token_ids[rows[j]] for j in idx],
                [rollout.completion_ids[j] for j in idx],
                tokenizer.pad_token_id,
            )
            micro_batches.append(
                {
                    "sequences": batch.tensors(accelerator.device),  # the policy's forward arguments
                    "mask": (batch.completion_mask * row_weight[idx, None]).to(accelerator.device),  # [mb, C]
                    "advantages": advantages[idx].to(accelerator.device),  # [mb]
                }
            )
            if rollout.sampling_logprobs is not None:  # the sampler's own log-probs (vLLM engines)
                sampled = [rollout.sampling_logprobs[j] for j in idx]
                micro_batches[-1]["sampling_logp"] = _pad(sampled, batch.num_completion_tokens).to(accelerator.device)
        # Normalisers count every completion, trained or not: skipping never changes the loss.
        totals = accelerator.reduce(torch.tensor([float((lengths * keep).sum())], device=accelerator.device), "sum")
        total_tokens = float(totals[0])
        with torch.no_grad():
            for mb in micro_batches:
                if cfg.train.num_iterations > 1:  # with mu = 1 the old policy *is* the current one: no extra pass
                    mb["old_logp"], _ = policy(**mb["sequences"])
                if cfg.loss.beta > 0:
                    mb["ref_logp"] = reference_logprobs(mb["sequences"])
        timing.stop("timing/logprobs")

        # ---- 4. num_iterations optimizer steps on this batch
        timing.start("timing/update")
        # loss, clip_low, clip_high, clip_region, kl, entropy, |sampler-trainer logp| sum, max, tokens trained, completions trained
        sums = torch.zeros(10, device=accelerator.device)
        sums[9] = local_n if trainable is None else len(trainable)
        grad_norm = torch.tensor(math.nan)
        skipped = 0
        for iteration in range(cfg.train.num_iterations):
            for mb in micro_batches:
                with accelerator.accumulate(policy):
                    logp, entropy = policy(**mb["sequences"], with_entropy=iteration == 0)
                    token_loss, parts = losses.token_loss(
                        logp,
                        mb.get("old_logp", logp.detach()),
                        mb["advantages"],
                        mb["mask"],
                        cfg.loss.type,
                        epsilon_low=cfg.loss.epsilon_low,
                        epsilon_high=cfg.loss.epsilon_high_value,
                        delta=cfg.loss.delta,
                        ref_logp=mb.get("ref_logp"),
                        beta=cfg.loss.beta,
                    )
                    if "sampling_logp" in mb and cfg.loss.tis_cap is not None:
                        token_loss = token_loss * losses.truncated_importance_weight(
                            mb.get("old_logp", logp.detach()), mb["sampling_logp"], cfg.loss.tis_cap
                        )
                    share = losses.aggregate(
                        token_loss,
                        mb["mask"],
                        cfg.loss.type,
                        total_sequences=local_n * world,
                        total_tokens=total_tokens,
                        max_completion_length=cfg.rollout.max_completion_length,
                        total_micro_batches=len(micro_batches) * world,
                    )
                    # Accelerate divides by grad_accum and the ranks' gradients are averaged: undo both,
                    # so the shares of all micro-batches on all ranks add up to the batch loss.
                    accelerator.backward(share * grad_accum * world)
                    if accelerator.sync_gradients:
                        # The norm is global (reduced over ranks), so every rank takes the same decision.
                        grad_norm = distributed.global_grad_norm(accelerator, policy, cfg.train.max_grad_norm)
                        if torch.isfinite(grad_norm):
                            optimizer.step()
                            scheduler.step()
                            nonfinite_in_a_row = 0
                        else:
                            nonfinite_in_a_row, skipped = nonfinite_in_a_row + 1, skipped + 1
                            _guard_nonfinite(step, float(share), float(grad_norm), nonfinite_in_a_row, cfg)
                    optimizer.zero_grad(set_to_none=True)
                # Averaged over iterations: clipping only happens once the batch is reused (iteration > 0).
                sums[:5] += torch.stack(
                    [share.detach(), parts["clip_low"], parts["clip_high"], parts["clip_region"], torch.as_tensor(parts.get("kl", 0.0))]
                ) / cfg.train.num_iterations
                if iteration == 0:
                    sums[5] += (entropy * mb["mask"]).sum()
                    sums[8] += mb["mask"].sum()
                    if "sampling_logp" in mb:
                        gap = (logp.detach() - mb["sampling_logp"]).abs() * mb["mask"]
                        sums[6] += gap.sum()
                        sums[7] = torch.maximum(sums[7], gap.max())
        timing.stop("timing/update")
        timing.start("timing/weight_sync")
        bare_lm = accelerator.unwrap_model(policy).lm
        with distributed.gathered_if_zero3(accelerator, bare_lm):
            engine.sync_weights(bare_lm)
        accelerator.wait_for_everyone()  # a server engine is pushed to by the main process only
        timing.stop("timing/weight_sync")

        eval_metrics: dict[str, float] = {}
        if cfg.eval.every and step % cfg.eval.every == 0:
            timing.start("timing/eval")
            if accelerator.is_main_process:
                # Forked RNG inside: the training random stream (and so exact resume) is untouched.
                eval_metrics = (evaluate_model(accelerator.unwrap_model(policy).lm, tokenizer, cfg, data=eval_data, progress=False))
            accelerator.wait_for_everyone()
            timing.stop("timing/eval")

        # ---- 5. metrics (reduced over ranks), progress, checkpoint
        gap_max = accelerator.reduce(sums[7:8].clone(), "max").cpu()  # a max, not a sum, over ranks
        sums = accelerator.reduce(sums, "sum").cpu()
        all_lengths = accelerator.gather(lengths.to(accelerator.device)).cpu()
        all_truncated = accelerator.gather(torch.tensor(rollout.truncated, dtype=torch.float32, device=accelerator.device)).cpu()
        record = {
            "step": step,
            **reward_stats,
            "loss": float(sums[0]),
            "learning_rate": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "nonfinite_skipped": skipped,
            "completions/mean_length": float(all_lengths.mean()),
            "completions/max_length": float(all_lengths.max()),
            "completions/clipped_ratio": float(all_truncated.mean()),
            **_length_by_outcome(all_lengths, all_rewards),
            "entropy": float(sums[5]) / max(float(sums[8]), 1),  # over the completions that were trained on
            "completions/trained_fraction": float(sums[9]) / (local_n * world),
            "clip_ratio/low_mean": float(sums[1]) / max(total_tokens, 1),
            "clip_ratio/high_mean": float(sums[2]) / max(total_tokens, 1),
            "clip_ratio/region_mean": float(sums[3]) / max(total_tokens, 1),
            **({"kl": float(sums[4]) / max(total_tokens, 1)} if cfg.loss.beta > 0 else {}),
            **(
                {"sampling/logp_diff_mean": float(sums[6]) / max(float(sums[8]), 1), "sampling/logp_diff_max": float(gap_max[0])}
                if rollout.sampling_logprobs is not None
                else {}
            ),
            **reward_metrics,
            **eval_metrics,
            **timing.seconds,
        }
        record["step_time"] = time.perf_counter() - step_start
        log_this_step = step % cfg.logging.log_every == 0 or step == cfg.train.max_steps
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 or step == cfg.train.max_steps:
            tick = time.perf_counter()
            history = metrics_out.history_with(record if log_this_step else None)
            state = {
                "sampler": sampler.state_dict(),
                "nonfinite_in_a_row": nonfinite_in_a_row,
                "world_size": world,
                "config": cfg.model_dump(mode="json"),
            }
            ckpt.save_checkpoint(
                accelerator, output_dir, step, state, cfg.checkpoint.keep_last, files={ckpt.METRICS_HISTORY: history}
            )
            record["timing/checkpoint"] = time.perf_counter() - tick
        if log_this_step:
            metrics_out.write(record)
            if trackers:
                accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step)
        if cfg.logging.completions_every and step % cfg.logging.completions_every == 0 and accelerator.is_main_process:
            samples = [
                {
                    "step": step,
                    "prompt": prompt_set.texts[rows[j]],
                    "completion": tokenizer.decode(rollout.completion_ids[j], skip_special_tokens=True),
                    "reward": float(all_rewards[rank * local_n + j]),
                    "advantage": float(advantages[j]),
                }
                for j in range(min(cfg.logging.num_completions, local_n))
            ]
            _write_completions(output_dir / "completions.jsonl", samples, cfg.logging.print_completions)
        progress.update(record)
        if on_step_end is not None:  # e.g. a profiler's step(), or a test's probe
            on_step_end(step)
        last = record

    progress.close()
    metrics_out.close()
    if cfg.checkpoint.save_final_model:
        _save_final_model(accelerator, policy, tokenizer, output_dir / "model")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(output_dir, cfg.train.max_steps - start_step, last, accelerator.is_main_process)


# ----------------------------------------------------------------------------- helpers


class PhaseTimer:
    """Wall seconds per phase of a step (the `timing/*` metrics), each phase also a torch.profiler range.

    A phase can be entered several times in a step (dynamic sampling draws again): its times add up.
    `scripts/profile_step.py` groups the profiled operators by these ranges.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: dict[str, tuple[float, torch.profiler.record_function]] = {}

    def start(self, name: str) -> None:
        marker = torch.profiler.record_function(name)
        marker.__enter__()
        self._open[name] = (time.perf_counter(), marker)

    def stop(self, name: str) -> None:
        started, marker = self._open.pop(name)
        marker.__exit__(None, None, None)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


@dataclass
class Group:
    """One prompt's G completions and their total rewards (NaN = no opinion)."""

    prompt_index: int
    completion_ids: list[list[int]]
    truncated: list[bool]
    rewards: list[float]

    @property
    def informative(self) -> bool:
        valid = [r for r in self.rewards if not math.isnan(r)]
        return len(valid) >= 2 and max(valid) > min(valid)


def _dynamic_sampling(accelerator, sample_and_score, next_local_indices, cfg: Config, local_prompts: int):
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): keep only groups whose rewards differ, sample more prompts
    until the batch holds prompts_per_step of them, at most `loss.max_sampling_rounds` extra rounds.

    Every rank sees the kept groups of all ranks (gather_object of token ids), so the batch is
    refilled evenly. Groups beyond the batch are dropped, never carried over: data from an
    older policy would make the step silently off-policy. If the bound is hit, the batch is
    topped up with degenerate groups (advantage 0, so they add no gradient) and a warning says so.
    """
    from accelerate.utils import gather_object

    target = cfg.train.prompts_per_step
    g = cfg.rollout.num_generations
    kept: list[Group] = []
    degenerate: list[Group] = []
    generated = 0
    first_rewards = None
    reward_metrics: dict[str, float] = {}
    for round_index in range(cfg.loss.max_sampling_rounds + 1):
        local_indices = next_local_indices()
        rollout, reward_batch = sample_and_score(local_indices)
        if round_index == 0:
            reward_metrics = reward_batch.metrics
        totals = reward_batch.total.tolist()
        local_groups = [
            Group(p, rollout.completion_ids[j * g : (j + 1) * g], rollout.truncated[j * g : (j + 1) * g], totals[j * g : (j + 1) * g])
            for j, p in enumerate(local_indices)
        ]
        all_groups: list[Group] = gather_object(local_groups)  # rank order, identical on every rank
        if first_rewards is None:
            first_rewards = torch.tensor([r for grp in all_groups for r in grp.rewards])
        generated += len(all_groups)
        for grp in all_groups:
            (kept if grp.informative else degenerate).append(grp)
        if len(kept) >= target:
            break
    rounds = round_index
    short = max(0, target - len(kept))
    if short:
        logger.warning(
            "dynamic sampling: only %d of %d groups had differing rewards after %d extra rounds "
            "(loss.max_sampling_rounds); %d degenerate groups fill the batch and add no gradient",
            len(kept), target, rounds, short,
        )
    batch = (kept + degenerate[:short])[:target]
    rank = accelerator.process_index
    mine = batch[rank * local_prompts : (rank + 1) * local_prompts]
    rollout = Rollout(
        completion_ids=[c for grp in mine for c in grp.completion_ids],
        truncated=[t for grp in mine for t in grp.truncated],
    )
    all_rewards = torch.tensor([r for grp in batch for r in grp.rewards])
    _, first_stats = group_advantages(first_rewards, g, "none")
    stats = {
        # Of the first round, i.e. of what the policy does, not of the filtered batch.
        **{k: first_stats[k] for k in ("reward", "reward_std", "frac_reward_zero_std")},
        "dynamic_sampling/extra_rounds": float(rounds),
        "dynamic_sampling/generated_groups": float(generated),
        "dynamic_sampling/kept_groups": float(min(len(kept), target)),
        "dynamic_sampling/filled_degenerate_groups": float(short),
    }
    return [grp.prompt_index for grp in mine], rollout, all_rewards, reward_metrics, stats



def _batch_geometry(cfg: Config, world: int) -> tuple[int, int]:
    """Prompts per rank and micro-batches per optimizer step, or a ConfigError saying what to change."""
    if cfg.train.prompts_per_step % world:
        raise ConfigError(
            f"train.prompts_per_step ({cfg.train.prompts_per_step}) must be divisible by the number of processes ({world})"
        )
    local_prompts = cfg.train.prompts_per_step // world
    local_n = local_prompts * cfg.rollout.num_generations
    if local_n % cfg.train.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size ({cfg.train.micro_batch_size}) must divide the completions per process "
            f"({local_prompts} prompts x {cfg.rollout.num_generations} generations = {local_n})"
        )
    return local_prompts, local_n // cfg.train.micro_batch_size


def _vllm_engine_kwargs(cfg: Config, accelerator) -> dict:
    """What the vLLM engines need beyond the common sampling settings (see rollout/vllm_*.py)."""
    from .tiny import resolve_model_path

    settings = cfg.rollout.vllm.model_dump()  # the rollout.vllm section maps 1:1 onto the engines' arguments
    if settings["dtype"] == "auto":
        # The trainer's dtype. vLLM's own "auto" runs a float32 checkpoint in bfloat16, and the
        # sampler/trainer log-prob gap grows from ~3e-7 to ~5e-3 nats (measured, tests/test_vllm.py).
        settings["dtype"] = cfg.model.dtype
    return dict(
        **settings,
        model_path=resolve_model_path(cfg.model.name_or_path),
        seed=cfg.seed + accelerator.process_index,  # ranks must not share a random stream
        is_main_process=accelerator.is_main_process,
    )


def _micro_batch_rows(local_n: int, micro: int, trainable: list[int] | None, lengths: torch.Tensor) -> list[list[int]]:
    """The completions (row indices) each micro-batch trains on.

    All rows, `micro` at a time, unless `trainable` lists the rows worth a pass. Then those rows are
    spread evenly, in order (groups stay together), over the *same number* of micro-batches: gradient
    accumulation and DDP/ZeRO synchronisation count on every rank making the same number of backward
    calls. A micro-batch left with nothing gets the shortest other row: its advantage is 0 (or its
    tokens masked), and the caller masks all its tokens, so it adds nothing to the gradient or the
    metrics: only the backward call itself is kept.
    """
    n_micro = math.ceil(local_n / micro)
    if trainable is None:
        return [list(range(start, min(start + micro, local_n))) for start in range(0, local_n, micro)]
    sizes = [len(trainable) // n_micro + (1 if i < len(trainable) % n_micro else 0) for i in range(n_micro)]
    chunks, start = [], 0
    for size in sizes:
        chunks.append(trainable[start : start + size])
        start += size
    if any(not chunk for chunk in chunks):
        chosen = set(trainable)
        filler = min((j for j in range(local_n) if j not in chosen), key=lambda j: float(lengths[j]))
        chunks = [chunk or [filler] for chunk in chunks]
    return chunks


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([r[:width] + [0.0] * (width - len(r[:width])) for r in rows], dtype=torch.float32)


def _mix_seed(*parts: int) -> int:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) % (2**63)
    return value


def _guard_nonfinite(step: int, loss: float, grad_norm: float, in_a_row: int, cfg: Config) -> None:
    """Skip-and-count a non-finite update; stop the run once too many come in a row."""
    if in_a_row > cfg.train.max_consecutive_nonfinite:
        raise TrainingError(
            f"step {step}: {in_a_row} optimizer steps in a row had a non-finite loss or gradient (loss {loss}, "
            f"grad norm {grad_norm}); stopping (train.max_consecutive_nonfinite={cfg.train.max_consecutive_nonfinite}). "
            "Lower train.learning_rate, keep train.max_grad_norm set, try model.dtype=float32, and check the rewards."
        )
    logger.warning(
        "step %d: non-finite loss or gradient (loss %s, grad norm %s): optimizer step skipped (%d in a row)",
        step, loss, grad_norm, in_a_row,
    )


def _write_completions(path: Path, samples: list[dict], echo: bool) -> None:
    """Append samples to completions.jsonl; with `echo`, print them as a table too."""
    with path.open("a") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    if echo:
        width = 48
        cut = lambda text: (text.replace("\n", " ")[-width:]).ljust(width)  # noqa: E731 (prompt ends matter most)
        lines = [f"{'prompt (end)':<{width}} | {'completion':<{width}} | reward | advantage"]
        lines += [f"{cut(s['prompt'])} | {s['completion'].replace(chr(10), ' ')[:width]:<{width}} | {s['reward']:6.3f} | {s['advantage']:+.3f}" for s in samples]
        logger.info("completions at step %d:\n%s", samples[0]["step"], "\n".join(lines))


def _flat_hparams(cfg: Config) -> dict:
    """The config as flat scalars, which is what tensorboard's hparams accept."""
    flat = ckpt.flatten(cfg.model_dump(mode="json"))
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


def _find_checkpoint(cfg: Config):
    try:
        return ckpt.find_resume_checkpoint(cfg.output_dir, cfg.checkpoint.resume)
    except FileNotFoundError as exc:
        raise TrainingError(str(exc)) from None


def _length_by_outcome(lengths: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Mean completion length of rewarded (total reward > 0) vs unrewarded completions: the length-bias monitor."""
    valid = ~torch.isnan(rewards)
    correct, incorrect = valid & (rewards > 0), valid & (rewards <= 0)
    return {
        "completions/mean_length_correct": float(lengths[correct].mean()) if correct.any() else math.nan,
        "completions/mean_length_incorrect": float(lengths[incorrect].mean()) if incorrect.any() else math.nan,
    }


def _save_final_model(accelerator, policy, tokenizer, folder: Path) -> None:
    """save_pretrained of the bare LM (gathering sharded parameters first, where sharded).

    LoRA runs write the adapter alone to `adapter/` beside it, and the merged model to `folder`.
    """
    state_dict = accelerator.get_state_dict(policy)  # collective under ZeRO-3 / FSDP
    if accelerator.is_main_process:
        lm = accelerator.unwrap_model(policy).lm
        if is_lora(lm):
            lm.save_pretrained(folder.parent / "adapter")
            tokenizer.save_pretrained(folder.parent / "adapter")
            plain_model(lm).save_pretrained(folder)
        else:
            lm.save_pretrained(folder, state_dict={k.removeprefix("lm."): v for k, v in state_dict.items()})
        tokenizer.save_pretrained(folder)
        logger.info("saved the final model to %s", folder)


def _setup_logging(cfg: Config, is_main: bool) -> None:
    level = getattr(logging, cfg.logging.level.upper()) if is_main else logging.WARNING
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[grpo_trainer] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _progress_bar:
    """tqdm bar with step, reward and ETA on the main process; plain log lines when the bar is off."""

    def __init__(self, cfg: Config, is_main: bool, start_step: int):
        self.enabled = is_main
        self.bar = None
        if is_main and cfg.logging.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        summary = {"reward": f"{record['reward']:.3f}", "loss": f"{record['loss']:.4f}", "len": f"{record['completions/mean_length']:.1f}"}
        if self.bar is not None:
            self.bar.set_postfix(summary, refresh=False)
            self.bar.update(1)
        else:
            logger.info("step %d %s step_time=%.2fs", record["step"], " ".join(f"{k}={v}" for k, v in summary.items()), record["step_time"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
