"""The rollout engine registry: `build_engine(cfg, ...)` returns the engine `rollout.engine` names.

What each engine can do is declared by its entry in `engines.py` (read by the config's checks without importing
any engine); the built engine says the same by its capability classes (rollout/__init__.py). This is the one place
that tells engines apart by name.

Kept apart from the package's `__init__` (the types every engine imports), so that the engines, imported
here lazily, never import the module that imports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import RolloutEngine, SamplingSettings
from .engines import engine_kind
from .kernel_plan import KernelPlanning

if TYPE_CHECKING:
    from ..config import Config


def build_engine(
    cfg: Config,
    sampling: SamplingSettings,
    *,
    get_model: Callable[[], torch.nn.Module],
    pad_token_id: int,
    tokenizer=None,
    full_parameters: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
    rank: int = 0,
    is_main_process: bool = True,
    lockstep=None,
    kernels: KernelPlanning | None = None,
) -> RolloutEngine:
    """The engine `rollout.engine` names, given what only the trainer knows (the model, its sharding, the rank;
    the tokenizer, which the `hf` engine needs for stop strings; `lockstep`, the ranks' collectives where every
    forward of the model is itself a collective, see HFEngine; `kernels`, the reach the hf engine plans its
    kernels for and how the ranks agree on the plan, kernel_plan.py). An environment's episode loop around it is
    the run builder's to add (environments/episodes.py's `with_environment`)."""
    name = engine_kind(cfg.rollout.engine).name  # an unknown name: one line listing the engines there are
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(
            sampling,
            get_model=get_model,
            pad_token_id=pad_token_id,
            share_prompt=cfg.model.share_prompt,
            tokenizer=tokenizer,
            full_parameters=full_parameters or (lambda model: contextlib.nullcontext()),
            lockstep=lockstep,
            compile=cfg.rollout.hf.compile_mode if cfg.rollout.hf.compile else None,
            planning=kernels,
        )
    seed = cfg.seed + rank  # ranks must not share a random stream
    from .lora_sync import push_adapters

    adapters = push_adapters(cfg, get_model())  # rollout.lora_sync: ConfigError or one logged line where it cannot
    if name == "vllm_colocate":
        from ..builtin import resolve_model_path
        from .vllm_colocate import VLLMColocateEngine

        settings = cfg.rollout.vllm
        if settings.dtype == "auto":
            # The trainer's dtype. vLLM's own "auto" runs a float32 checkpoint in bfloat16, and the
            # sampler/trainer log-prob gap grows from ~3e-7 to ~5e-3 nats (measured, tests/test_vllm.py).
            settings = settings.model_copy(update={"dtype": cfg.model.dtype})
        return VLLMColocateEngine(
            sampling,
            settings,
            model_path=resolve_model_path(cfg.model.name_or_path),
            seed=seed,
            lora_rank=cfg.model.lora.r if adapters and cfg.model.lora else None,
        )
    if name == "vllm_server":
        from .vllm_server import VLLMServerEngine

        return VLLMServerEngine(
            sampling,
            cfg.rollout.vllm_server,
            seed=seed,
            is_main_process=is_main_process,
            lora_sync=cfg.rollout.lora_sync if adapters else "merged",
            server_dtype=_torch_dtype(cfg.rollout.vllm.dtype),  # what `serve` starts it with, for the push probe
            max_staleness=cfg.rollout.max_staleness,  # adapters in-flight requests may still name stay loaded
        )
    raise NotImplementedError(f"rollout.engine: the engine {name!r} has an entry in engines.py but no builder here")


if TYPE_CHECKING:
    # mypy checks that every engine class satisfies RolloutEngine, members and signatures (`make lint`; the episode
    # loop's wrapper is checked in environments/episodes.py); tests/test_engines.py checks the same at run time.
    from .hf import HFEngine
    from .vllm_colocate import VLLMColocateEngine
    from .vllm_server import VLLMServerEngine

    _hf: type[RolloutEngine] = HFEngine
    _vllm_colocate: type[RolloutEngine] = VLLMColocateEngine
    _vllm_server: type[RolloutEngine] = VLLMServerEngine


def _torch_dtype(name: str) -> torch.dtype | None:
    """`rollout.vllm.dtype` as a torch dtype (vLLM's names: float32, bfloat16, half, ...); None for `auto` (the
    trainer's) or a name torch does not know."""
    dtype = getattr(torch, {"half": "float16", "float": "float32"}.get(name, name), None)
    return dtype if isinstance(dtype, torch.dtype) else None
