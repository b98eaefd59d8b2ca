"""What lives for the whole run, built once: `build_run(cfg) -> Run`, then `resume(run) -> TrainState`, and
`finish(run)`. What a checkpoint saves and how a run is restored from one is checkpoint.py's (`save_step`,
`restore`).

The `Run` holds the components a step's phases work with, frozen: the accelerator and its collectives, the batch
geometry, the tokenizer, the policy (wrapped by Accelerate), the loss terms (with the reference and the teacher
they score with), the optimizer and schedule, the rollout engine, the task (prompts + rewards), the prompt
sampler, the rollout queue and the writers. What a step changes and a checkpoint saves is a
`train_state.TrainState`, handed from step to step by the loop. Only the loop (trainer.py) and this module take
the `Run`: each phase is given the parts it reads.

Order matters for exact resume and for "same seed, same run": every rank seeds
identically before any model is loaded (so random inits agree), and only after
the engine exists does each rank switch to its own random stream for sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import distributed
from .config import Config, ModelConfig
from .cpu import paths as cpu_paths
from .cpu.adamw import adamw_for
from .cpu.heap import HeapTrimmer
from .data import PromptSampler
from .environments import build_environment
from .environments.checks import check_environment
from .environments.episodes import with_environment
from .errors import ConfigError
from .evaluate import load_eval_task
from .export import save_model
from .geometry import Geometry, batch_geometry
from .metrics import MetricsWriter
from .model_card import setup_of, write_model_card
from .models import (
    TokenLogprobs,
    base_model,
    check_packing_support,
    check_same_vocabulary,
    context_length,
    eos_token_ids,
    is_lora,
    load_causal_lm,
    load_tokenizer,
)
from .preflight import check_model_sources, run_preflight
from .report import ProgressBar, flat_hparams
from .rollout import PlansKernels, RolloutEngine, capability, sampling_settings
from .rollout.engines import engine_kind
from .rollout.kernel_plan import DecodeReach, KernelPlanning
from .rollout.registry import build_engine
from .rollout_queue import QueueSettings, RolloutQueue, weight_pusher
from .task import Task, load_task
from .terms import LossTerm, TermModels, build_terms
from .trackers import start_trackers
from .train_state import TrainState

logger = logging.getLogger("grpo_trainer")


@dataclass(frozen=True)
class Run:
    cfg: Config
    accelerator: Any
    comm: distributed.Collectives
    geometry: Geometry
    tokenizer: Any
    policy: Any  # TokenLogprobs, as Accelerate prepared it (DDP / DeepSpeed engine / plain)
    terms: tuple[LossTerm, ...]  # the loss's optional terms (terms/), with the frozen models they score with
    optimizer: Any
    scheduler: Any  # stepped by us, not by Accelerate (its wrapper would step once per process)
    engine: RolloutEngine
    task: Task
    sampler: PromptSampler
    metrics: MetricsWriter
    trackers: list[str]  # Accelerate trackers (tensorboard, wandb); jsonl is `metrics`, always on
    rollouts: RolloutQueue  # what is sampled when, with which weights; the pushes
    progress: ProgressBar  # started by `resume`, at the step the run continues from
    heap_trimmer: HeapTrimmer  # called where a phase's peak begins (cpu/heap.py)
    eval_task: Task | None = None  # when eval.every > 0

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def resumable(self) -> ckpt.Resumable:
        """What a checkpoint saves and a resume restores, beside the `TrainState` (checkpoint.save_step, restore)."""
        return ckpt.Resumable(
            self.cfg, self.accelerator, self.geometry.world, self.sampler, self.rollouts, self.metrics
        )

    def bare_lm(self) -> torch.nn.Module:
        """The causal LM inside the wrappers (DDP, DeepSpeed, TokenLogprobs): what engines and saving need."""
        return distributed.unwrap(self.accelerator, self.policy).lm


def build_run(cfg: Config) -> Run:
    """Accelerator, models, optimizer, engine, task and writers, identical on every rank up to the sampling seed."""
    from accelerate.utils import set_seed

    accelerator, geometry, trackers = _start_processes(cfg)
    set_seed(cfg.seed)  # identical on every rank: same random inits
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    lm = load_causal_lm(cfg.model)
    if cfg.train.packing:
        check_packing_support(lm)
    environment = build_environment(cfg)  # environment.tools alone is the built-in tools environment
    task = _training_task(cfg, tokenizer, lm, environment)
    geometry.check_room(max(map(len, task.prompts.token_ids)), cfg.rollout.max_completion_length)
    policy, optimizer, scheduler = _policy_and_optimizer(cfg, accelerator, lm, geometry)
    # Loaded before the per-rank seed below, as the policy: a load that draws random numbers draws alike everywhere.
    reference, teacher = _reference(cfg, accelerator, lm), _teacher(cfg, accelerator, tokenizer)
    comm = distributed.Collectives(accelerator)
    # every rank evaluates (see trainer.periodic_eval); loaded before the engine, whose kernel plan covers it
    eval_task = load_eval_task(cfg, tokenizer, context_length(lm), environment=environment) if cfg.eval.every else None

    def bare_lm() -> torch.nn.Module:  # what Run.bare_lm returns: for the engine's sampling and the weight pushes
        return distributed.unwrap(accelerator, policy).lm

    kernels = KernelPlanning(
        decode_reach(cfg, geometry, task, eval_task),
        decides=accelerator.is_main_process,
        share=(lambda item: comm.gather_objects([item])[0]) if geometry.world > 1 else None,
    )
    engine = _engine(cfg, accelerator, comm, policy, bare_lm, tokenizer, lm, environment, kernels)
    set_seed(cfg.seed + accelerator.process_index)  # from here on, ranks sample different completions
    sampler = PromptSampler(len(task), seed=cfg.seed, shuffle=cfg.data.shuffle)
    settings = QueueSettings.of(cfg)
    push = weight_pusher(engine, comm, bare_lm, accelerator, settings.checkpoints)
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        comm=comm,
        geometry=geometry,
        tokenizer=tokenizer,
        policy=policy,
        terms=build_terms(cfg, TermModels(reference_scorer(cfg, reference, accelerator, policy), teacher)),
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        task=task,
        sampler=sampler,
        metrics=MetricsWriter(Path(cfg.output_dir), enabled=accelerator.is_main_process),
        trackers=trackers,
        rollouts=RolloutQueue(engine, settings, geometry=geometry, comm=comm, task=task, sampler=sampler, push=push),
        progress=ProgressBar(cfg, accelerator.is_main_process),
        heap_trimmer=_heap_trimmer(cfg, accelerator, lm),
        eval_task=eval_task,
    )


def _start_processes(cfg: Config) -> tuple[Any, Geometry, list[str]]:
    """The Accelerator, the batch geometry on this rank and the trackers; logging set up, and what cannot work
    here refused (preflight) before any model loads."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    # The world size is needed before the Accelerator exists (it fixes gradient accumulation).
    geometry = batch_geometry(cfg, distributed.partial_state().num_processes)
    trackers: list[str] = [t for t in cfg.logging.report_to if t != "jsonl"]  # jsonl is ours, always on
    output_dir = Path(cfg.output_dir)
    accelerator = Accelerator(
        # Fixed by train.micro_batch_size; under a token budget update.py sets it per optimizer step.
        gradient_accumulation_steps=geometry.accumulation_steps or 1,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "trackers")),
    )
    geometry = replace(geometry, rank=accelerator.process_index)
    setup_logging(cfg, accelerator.is_main_process)
    distributed.check_distributed_setup(accelerator)
    run_preflight(cfg)
    logger.info(
        "world_size=%d distributed_type=%s device=%s mixed_precision=%s prompts_per_rank=%d completions_per_rank=%d "
        "grad_accum=%s",
        geometry.world,
        accelerator.distributed_type.value,
        accelerator.device,
        distributed.mixed_precision(accelerator),
        geometry.prompts_per_rank,
        geometry.completions_per_rank,
        geometry.accumulation_steps or f"per step (train.micro_batch_tokens={geometry.micro_batch_tokens})",
    )
    return accelerator, geometry, trackers


def _engine(cfg: Config, accelerator, comm, policy, bare_lm, tokenizer, lm, environment, kernels) -> RolloutEngine:
    """The rollout engine, sampling from `bare_lm()` (whole parameters under ZeRO-3) or its own copy, its kernels
    planned for `kernels` (the hf engine); with an environment, the episode loop around it."""
    sampling = sampling_settings(cfg, eos_token_ids(tokenizer, lm))
    sampler = build_engine(
        cfg,
        sampling,
        get_model=bare_lm,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        full_parameters=lambda _lm: distributed.zero3_sampling_context(accelerator, policy),
        rank=accelerator.process_index,
        is_main_process=accelerator.is_main_process,
        lockstep=distributed.sampling_lockstep(accelerator, comm),
        kernels=kernels,
    )
    return with_environment(sampler, tokenizer, cfg, sampling, environment)


def _training_task(cfg: Config, tokenizer, lm, environment) -> Task:
    """The prompts and rewards a run trains on, told of the environment that plays its episodes (its tools in the
    prompts, its reward beside the config's)."""
    return load_task(
        cfg.data,
        cfg.rewards,
        tokenizer,
        context_length(lm),
        policy_dtype=cfg.model.dtype,
        tools=environment.tools or None if environment else None,
        environment=environment,
        environment_config=cfg.environment,
    )


def _heap_trimmer(cfg: Config, accelerator, lm) -> HeapTrimmer:
    """`train.trim_host_memory`'s trimmer, watching the backward of `lm`'s input embeddings and decoder layers (the
    classes transformers keeps whole when sharding: `_no_split_modules`)."""
    trimmer = HeapTrimmer.for_model(cfg.train.trim_host_memory, accelerator.device.type, lm)
    base = base_model(lm)
    block_classes = set(getattr(base, "_no_split_modules", None) or [])
    trimmer.watch_backward(
        base.get_input_embeddings(), [m for m in base.modules() if type(m).__name__ in block_classes]
    )
    return trimmer


def chunk_agreement(accelerator) -> Callable[[int], int] | None:
    """What TokenLogprobs gets as `agree_chunks`: where every module call is a collective (ZeRO-3, multi-process
    FSDP), the largest of the ranks' chunk counts, since each rank's count follows its own completion lengths and
    a rank that called the output head less often would leave the others waiting in its weight gather; None
    elsewhere (each rank scores its own chunks)."""
    if not distributed.module_calls_are_collective(accelerator):
        return None
    comm = distributed.Collectives(accelerator)
    return lambda chunks: int(comm.max(torch.tensor([chunks]))[0])


def _policy_and_optimizer(cfg: Config, accelerator, lm, geometry: Geometry):
    from transformers import get_scheduler

    if cfg.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = TokenLogprobs(
        lm, cfg.rollout.temperature, cfg.model.logprob_chunk_size, cfg.model.share_prompt, chunk_agreement(accelerator)
    )
    optimizer = adamw_for(accelerator)(  # on CPU, torch's AdamW step without its parameter-sized temporaries
        [p for p in policy.parameters() if p.requires_grad],
        lr=cfg.train.learning_rate,
        betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = get_scheduler(
        "constant_with_warmup" if cfg.train.lr_scheduler == "constant" else cfg.train.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.train.warmup_steps,
        num_training_steps=geometry.optimizer_steps,
    )
    distributed.fill_deepspeed_config(accelerator, cfg)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # unprepared: Accelerate's wrapper steps once per process
    return policy, optimizer, scheduler


def _reference(cfg: Config, accelerator, lm) -> TokenLogprobs | None:
    """A frozen copy for the KL term; none with beta = 0, and none for LoRA (the adapter-disabled policy is it)."""
    if not cfg.needs_reference or is_lora(lm):  # is_lora: an in-memory model given with its adapters
        return None
    return _frozen_copy(cfg, cfg.model, accelerator)


def reference_scorer(cfg: Config, reference: TokenLogprobs | None, accelerator, policy) -> Callable[..., Any] | None:
    """What scores the reference's log-probs for the KL term: the frozen copy, or for LoRA the policy itself with
    its adapters switched off (no second copy)."""
    if not cfg.loss.kl_on or reference is not None:
        return reference

    def adapters_off(**sequences):
        bare = distributed.unwrap(accelerator, policy)
        with bare.lm.disable_adapter():
            return bare(**sequences)

    return adapters_off


def _teacher(cfg: Config, accelerator, tokenizer) -> TokenLogprobs | None:
    """The frozen teacher (loss.teacher_kl), scored like the reference: a whole copy per rank, log-probs in chunks.
    Its tokenizer must map every token as the policy's does: its log-prob of the sampled ids is the reward."""
    if cfg.teacher is None:
        return None
    teacher_cfg = cfg.teacher.as_model(cfg.model)
    check_same_vocabulary(tokenizer, load_tokenizer(teacher_cfg), f"teacher.name_or_path {cfg.teacher.name_or_path}")
    return _frozen_copy(cfg, teacher_cfg, accelerator)


def _frozen_copy(cfg: Config, model: ModelConfig, accelerator) -> TokenLogprobs:
    """A frozen model scored beside the policy (the reference, the teacher): whole on every rank, also under
    ZeRO-3 (Accelerate never prepares it, so a partitioned load would leave it empty shards), so its forward is
    no collective and each rank scores its own chunks."""
    with distributed.whole_parameters_on_load():
        lm = load_causal_lm(model)
    scorer = TokenLogprobs(lm, cfg.rollout.temperature, cfg.model.logprob_chunk_size, cfg.model.share_prompt)
    return scorer.to(accelerator.device).eval().requires_grad_(False)


def resume(run: Run) -> TrainState:
    """The state to continue from (`checkpoint.restore`: the checkpoint's, loaded into the components, or a fresh
    one) with the engine's kernel plan, settled with the plan the checkpoint recorded; then the run's outputs are
    opened."""
    cfg, accelerator = run.cfg, run.accelerator
    state, recorded = ckpt.restore(run.resumable)
    planner = capability(run.engine, PlansKernels)
    state = replace(state, decode_kernels=planner.settle_kernels(recorded) if planner is not None else {})
    if accelerator.is_main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.yaml").write_text(cfg.to_yaml())
        record_decode_kernels(run.output_dir, state.decode_kernels, accelerator.device.type)
        ckpt.remove_incomplete(run.output_dir)
    start_trackers(accelerator, cfg, flat_hparams(cfg))
    run.progress.start(state.step)
    return state


def decode_reach(cfg: Config, geometry: Geometry, task: Task, eval_task: Task | None) -> DecodeReach:
    """The most rows one decode step of a run holds (prompts per generate call x G, training or periodic eval)
    and the longest context it reaches (prompt + completion): what the hf engine's kernel plan must cover."""
    rows = (cfg.rollout.batch_size or geometry.prompts_per_rank) * geometry.group_size
    context = max(map(len, task.prompts.token_ids), default=0)
    if eval_task is not None:
        from .evaluate import DEFAULT_BATCH_PROMPTS, eval_settings

        rows = max(rows, min(len(eval_task), cfg.rollout.batch_size or DEFAULT_BATCH_PROMPTS) * eval_settings(cfg).k)
        context = max(context, max(map(len, eval_task.prompts.token_ids), default=0))
    return DecodeReach(rows, context + cfg.rollout.max_completion_length)


def record_decode_kernels(output_dir: Path, plan: Mapping[str, str], device_type: str) -> None:
    """The plan beside config.yaml, with the machine it was made for (what a reader comparing runs needs)."""
    import json

    from .rollout.kernels import machine_fingerprint

    record = {"machine": machine_fingerprint(device_type), "choices": dict(plan), "cpu_paths": cpu_paths.in_use()}
    (output_dir / "decode_kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def measure_decode_kernels(cfg: Config, remeasure: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """`python -m grpo_trainer kernels CONFIG`: this machine's kernel plan for what the config reaches (one
    process), as cached (measured where missing), and with `remeasure` timed again. Returns (before, after)."""
    from .rollout.decode import plan_decode_kernels

    if not engine_kind(cfg.rollout.engine).plans_kernels or not cfg.model.share_prompt:
        return {}, {}
    check_model_sources(cfg)  # one line naming the key, not a Hugging Face traceback
    check_environment(cfg, contact_server=False)  # a missing factory file: before the model loads
    geometry = batch_geometry(cfg, 1)
    tokenizer, lm = load_tokenizer(cfg.model, cfg.data.chat_template), load_causal_lm(cfg.model).eval()
    environment = _environment_for_kernels(cfg)
    task = _training_task(cfg, tokenizer, lm, environment)
    eval_task = load_eval_task(cfg, tokenizer, context_length(lm), environment=environment) if cfg.eval.every else None
    reach = decode_reach(cfg, geometry, task, eval_task)
    before = plan_decode_kernels(lm, reach.rows, reach.context)
    return before, plan_decode_kernels(lm, reach.rows, reach.context, remeasure=True) if remeasure else before


def _environment_for_kernels(cfg: Config):
    """The environment whose tools lengthen the prompts the plan covers. An `environment.url` server that does not
    answer is not needed to plan: the plan is then made for prompts without its tool schema, and says so (a run
    measures the longer contexts it reaches where the cache lacks them)."""
    if cfg.environment.kind != "url":
        return build_environment(cfg)
    try:
        return build_environment(cfg)
    except ConfigError as exc:
        logger.warning("kernels: planned for prompts without the environment's tool schema: %s", exc)
        return None


def finish(run: Run) -> None:
    """The run is done: save the final model (collective) and stop."""
    if run.cfg.checkpoint.save_final_model:
        _save_final_model(run, run.output_dir / "model")
    stop_run(run)


def stop_run(run: Run) -> None:
    """Close the writers and the engine, end the trackers (after the last step, or a preemption)."""
    run.progress.close()
    run.metrics.close()
    run.rollouts.close()
    run.engine.close()
    if run.task.environment is not None:  # built once for the run: its task, engine and evaluator played it
        run.task.environment.close()
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    distributed.keep_until_exit(run)


def _save_final_model(run: Run, folder: Path) -> None:
    """save_pretrained of the bare LM (gathering sharded parameters first, where sharded; collective).

    LoRA runs write the adapter alone to `adapter/` beside it, and the merged model to `folder`.
    """
    lm = run.bare_lm()
    if is_lora(lm):  # PEFT and the merge read the live parameters: whole ones under ZeRO-3 while gathered
        with distributed.gathered_if_zero3(run.accelerator, lm):
            if run.is_main_process:
                save_model(lm, run.tokenizer, folder, adapter_folder=folder.parent / "adapter")
    else:
        state_dict = distributed.full_state_dict(run.accelerator, run.policy)  # collective under ZeRO-3 / FSDP
        if run.is_main_process:
            save_model(lm, run.tokenizer, folder, state_dict={k.removeprefix("lm."): v for k, v in state_dict.items()})
    if run.is_main_process:
        write_model_card(folder, run.cfg, run.output_dir, setup_of(run.accelerator))  # README.md for the Hub
        logger.info("saved the final model to %s", folder)


def setup_logging(cfg: Config, is_main: bool) -> None:
    level = getattr(logging, cfg.logging.level.upper()) if is_main else logging.WARNING
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[grpo_trainer] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
