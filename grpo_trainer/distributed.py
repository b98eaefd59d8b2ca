"""Distributed plumbing that Accelerate leaves to its users: the process state, backend checks, DeepSpeed.

The trainer never branches on the backend except here, where a library forces it:
DeepSpeed wants batch sizes in its own config, ZeRO-3 shards parameters that generation
and weight pushes need whole, and on CPU-only machines Accelerate needs an explicit
gloo backend and can silently set up something other than what was launched.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

import torch

from .config import Config
from .errors import ConfigError


def partial_state():
    """Accelerate's process state, created before the Accelerator because the world size fixes gradient accumulation.

    The CPU flag is passed as the Accelerator would pass it (a state made without it pins a multi-process
    CPU run to one rank). Launched without CUDA, the process group needs an explicit backend: Accelerate
    would otherwise take a DeepSpeed launch on CPU for a single process.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    kwargs = {"backend": "gloo"} if launched and not torch.cuda.is_available() else {}
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), **kwargs)


def check_distributed_setup(accelerator) -> None:
    """Fail loudly when Accelerate silently set up something other than what the launch asked for."""
    for flag, wanted in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")):
        if os.environ.get(flag, "false").lower() == "true" and accelerator.distributed_type.value != wanted:
            raise ConfigError(
                f"the Accelerate config asks for {wanted} but Accelerate set up {accelerator.distributed_type.value}"
                + (" (Accelerate enables FSDP on GPUs only; on CPU use DeepSpeed or DDP)" if wanted == "FSDP" else "")
            )
    launched = launched_ranks()
    if launched > 1 and accelerator.num_processes != launched:
        raise ConfigError(
            f"{launched} processes were launched but Accelerate set up {accelerator.num_processes} "
            f"({accelerator.distributed_type.value}); on a CPU-only machine use a multi-process Accelerate config "
            "with use_cpu: true and ACCELERATE_USE_CPU=1 (see configs/accelerate/cpu_ddp.yaml)"
        )
    if launched > 1 and accelerator.distributed_type.value == "NO":
        raise ConfigError(f"{launched} processes were launched but Accelerate set up no distributed backend")


def fill_deepspeed_config(accelerator, cfg: Config) -> None:
    """DeepSpeed wants the micro-batch and clipping in its own config; `prepare` cannot infer them without a dataloader."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    # Under train.micro_batch_tokens a micro-batch has no fixed size (and accumulation is set per step): 1 each.
    micro = cfg.train.micro_batch_size if cfg.train.micro_batch_tokens is None else 1
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["train_batch_size"] = micro * accelerator.gradient_accumulation_steps * accelerator.num_processes
    ds["gradient_clipping"] = cfg.train.max_grad_norm or 0.0


def mixed_precision(accelerator) -> str:
    """The precision training really runs in: DeepSpeed's own config decides under DeepSpeed (Accelerate refuses
    `mixed_precision` beside a `deepspeed_config_file`), Accelerate's setting elsewhere."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        ds = plugin.deepspeed_config
        enabled = lambda key: str(ds.get(key, {}).get("enabled", False)).lower() == "true"  # noqa: E731
        return "bf16" if enabled("bf16") else "fp16" if enabled("fp16") else "no"
    return str(accelerator.mixed_precision)


def unwrap(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The module inside Accelerate's wrapper (DDP, a DeepSpeed engine), as `accelerator.unwrap_model` gives it.

    Accelerate's own function imports DeepSpeed whenever it is installed, to recognise its engine, and
    DeepSpeed announces itself on import ("Setting accelerator to CPU ..."), in runs that never use it. So
    DeepSpeed (and FSDP) runs go through Accelerate; the others have at most a DDP wrapper, peeled here.
    """
    if accelerator.distributed_type.value in ("DEEPSPEED", "FSDP"):
        return accelerator.unwrap_model(model)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def full_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict, gathered where parameters are sharded (collective under ZeRO-3 / FSDP);
    Accelerate's `get_state_dict`, without importing DeepSpeed where it is not used (see `unwrap`)."""
    if accelerator.distributed_type.value in ("DEEPSPEED", "FSDP"):
        return accelerator.get_state_dict(model)
    return unwrap(accelerator, model).state_dict()


def zero_stage(accelerator) -> int:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def gathered_if_zero3(accelerator, model):
    """Under ZeRO-3 each rank holds a shard of every weight: gather them for generation (and only then)."""
    if zero_stage(accelerator) == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def zero3_sampling_context(accelerator, engine):
    """Whole weights and no ZeRO-3 hooks while the hf engine samples from the training model.

    Gathering alone is not enough: DeepSpeed's per-module hooks would still run on every decode
    step and expect all ranks to make the same forward calls, but each rank stops decoding when
    its own completions end. DeepSpeed's `unwrap_model_for_generation` gathers the parameters,
    detaches the hooks and puts them back afterwards. Outside ZeRO-3: nothing to do.
    """
    if zero_stage(accelerator) == 3:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        return unwrap_model_for_generation(engine)
    return contextlib.nullcontext()


def start_accumulation(accelerator, steps: int) -> None:
    """The next `steps` backward calls make one optimizer step (`accelerator.accumulate` syncs gradients on the last).

    Accelerate counts backward calls from the start of the run against a fixed `gradient_accumulation_steps`; under
    a token budget the count changes from one optimizer step to the next, so it is set, and the count restarted, at
    the start of each (which changes nothing when the count is fixed)."""
    accelerator.gradient_accumulation_steps = steps
    accelerator.step = 0


def backward_divisor(accelerator) -> int:
    """What `accelerator.backward` divides a loss by: under DeepSpeed its engine's configured accumulation steps
    (fixed when the engine is built), elsewhere Accelerate's current `gradient_accumulation_steps`."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        return int(plugin.deepspeed_config["gradient_accumulation_steps"])
    return accelerator.gradient_accumulation_steps


def steps_without_backward(accelerator) -> bool:
    """Whether the optimizer can step on gradients set by hand (zeros), with no backward call: not under DeepSpeed
    (its engine steps inside `backward`) or FSDP / XLA / Megatron (gradients live in their own structures)."""
    return accelerator.distributed_type.value not in ("DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")


def forward_is_collective(accelerator) -> bool:
    """Whether every forward of the model is itself a collective while the hf engine samples, so that all ranks
    must make the same forward calls (the engine then runs in lockstep): under FSDP each layer all-gathers its
    parameters in its forward. Not under ZeRO-3, whose hooks are removed for sampling
    (`zero3_sampling_context`), nor DDP, nor one process: there ranks stop when their own completions end."""
    return accelerator.num_processes > 1 and accelerator.distributed_type.value == "FSDP"


def module_calls_are_collective(accelerator) -> bool:
    """Whether every call of a module in a training pass gathers its sharded parameters across ranks (ZeRO-3,
    FSDP with more than one process), so that all ranks must call each module equally often: the log-prob
    passes then agree on their chunk count (run.chunk_agreement), which follows each rank's own lengths."""
    return forward_is_collective(accelerator) or (accelerator.num_processes > 1 and zero_stage(accelerator) == 3)


def sampling_lockstep(accelerator, comm: Collectives) -> Collectives | None:
    """What the hf engine gets as `lockstep` (training rollouts and periodic evaluation alike): the ranks'
    collectives where a forward is one (`forward_is_collective`), else None (each rank stops when it is done)."""
    return comm if forward_is_collective(accelerator) else None


def global_grad_norm(accelerator, policy, max_norm: float | None) -> torch.Tensor:
    """Clip (when max_norm is set) and return the global gradient norm, the same on every rank.

    Under DeepSpeed the engine clips and steps inside `backward` and reports the norm afterwards,
    so a non-finite norm is counted there but the step cannot be skipped.
    """
    norm = accelerator.clip_grad_norm_(policy.parameters(), max_norm or math.inf)
    return torch.as_tensor(0.0 if norm is None else float(norm))


class Collectives:
    """The cross-rank operations the loop needs, on CPU tensors in and out.

    Every phase that combines ranks goes through this one small interface (Accelerate's collectives,
    moved to the device and back), so the phases run unchanged on one process, on many, and in the
    tests on a group of threads standing in for ranks (tests/helpers.py: ThreadCollectives).
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` [n, ...] concatenated in rank order: [world * n, ...]."""
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def gather_objects(self, items: list) -> list:
        """Every rank's list, concatenated in rank order (picklable items)."""
        from accelerate.utils import gather_object

        return gather_object(items)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), "sum").cpu()

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), "max").cpu()


def launched_ranks() -> int:
    """How many processes the launcher (torchrun, accelerate launch) started: WORLD_SIZE, 1 when unset."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# What a multi-process run leaves for the process's end (`keep_until_exit`); never read.
_KEPT_UNTIL_EXIT: list[object] = []


def keep_until_exit(components: object) -> None:
    """Keep a finished multi-process run's objects alive until the process ends (the CLI then leaves without
    teardown: `exit_without_teardown`).

    Releasing them when `train` returns destroyed the DDP model's reducer and with it the gloo process group it
    holds, after `end_training` had destroyed the group and the other rank had exited: the group's destructor
    joined a worker thread that waited on that peer forever, and the launch hung on a finished run (seen about
    once in ten two-rank launches; py-spy: ProcessGroupGloo::~ProcessGroupGloo in std::thread::join under
    Reducer::~Reducer). One process: nothing is kept."""
    if launched_ranks() > 1:
        _KEPT_UNTIL_EXIT.append(components)


def exit_without_teardown(code: int):
    """End a multi-process run's process now, without the interpreter's teardown.

    By then the run is over: checkpoints and the model are written, the writers closed, and the process group
    destroyed (`Accelerator.end_training`). What the teardown would still do is destroy C++ objects, and under
    DeepSpeed ZeRO-3 on gloo a communication thread can still be joinable then: the rank aborts ("terminate
    called without an active exception", SIGABRT) and a finished run reports a failed launch, intermittently
    (more often on a loaded machine). Nothing is left for the teardown to do that matters, so it is skipped.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def whole_parameters_on_load():
    """Load a model outside DeepSpeed ZeRO-3's partitioned init: transformers partitions every model loaded while
    a ZeRO-3 config is live, and a model Accelerate never prepares (the teacher, a reward model) then runs its
    forward on empty shards. Frozen copies that every rank holds whole are loaded inside this."""
    hf_deepspeed: Any = sys.modules.get("transformers.integrations.deepspeed")  # not imported: no ZeRO-3 config live
    if hf_deepspeed is None or not hf_deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    live = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = live
