"""Checks of a config against the files and the machine it will run on, before any model loads.

The schema (`config/`) judges what a config says on its own. This judges it against the world: a
resume path that must exist, a model the chosen engine can run here, trackers that can start here, and
settings that are legal but rarely meant (returned as warnings). `validate` prints both; `train` runs the
same checks first, so a run that cannot work stops in seconds with one line naming the key, not after
loading a model. What depends on the engine is asked of its entry (rollout/engines.py), not its name.
`train` also waits here for the vLLM servers of `rollout.engine: vllm_server` (up to
`rollout.vllm_server.startup_timeout`: a server may still be starting) and refuses an address where
something other than vLLM answers; `validate` does not (the servers may not be up while a config is written).
"""

from __future__ import annotations

import logging
import os

from .checkpoint import require_complete
from .config import Config
from .environments.checks import check_environment
from .errors import ConfigError
from .geometry import geometry_of
from .rollout.engines import engine_kind
from .trackers import check_installed as check_trackers_installed
from .trackers import check_ready as check_trackers_ready

logger = logging.getLogger("grpo_trainer")

# vLLM 0.32's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes),
# used when vLLM itself cannot be asked.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def preflight(cfg: Config) -> list[str]:
    """Raise ConfigError for a setting that cannot work here; return warnings for ones that probably do not
    do what was meant."""
    check_model_sources(cfg)
    check_lora_targets_early(cfg)
    check_environment(cfg, contact_server=False)
    if cfg.checkpoint.resume not in ("auto", "never"):
        require_complete(cfg.checkpoint.resume)
    if engine_kind(cfg.rollout.engine).vllm_in_process:
        _check_vllm_can_run(cfg)
    check_trackers_installed(cfg)
    check_trackers_ready(cfg)
    warnings = []
    optimizer_steps = geometry_of(cfg).optimizer_steps  # what the learning-rate schedule counts
    if cfg.train.warmup_steps >= optimizer_steps:
        warnings.append(
            f"train.warmup_steps ({cfg.train.warmup_steps}) is not below the run's {optimizer_steps} optimizer steps: "
            "the learning rate never reaches train.learning_rate"
        )
    if cfg.rollout.max_staleness and not cfg.loss.correction_on:
        warnings.append(
            f"rollout.max_staleness {cfg.rollout.max_staleness} without loss.tis_cap (null turns the rollout correction "
            f"off): completions sampled by weights up to {cfg.rollout.max_staleness} steps old are trained on as if the "
            "current policy had sampled them; set loss.tis_cap to auto (the default) or a number so the importance "
            "weight corrects the lag (docs/async.md)"
        )
    if cfg.model.dtype == "bfloat16" and _runs_on_cpu() and not cpu_has_bf16_instructions():
        warnings.append(
            "model.dtype: bfloat16 on a CPU without bfloat16 instructions (no avx512_bf16/amx_bf16) is emulated and far "
            "slower than float32 (SmolLM2-135M, one forward + backward: 3.3x; docs/performance.md); "
            "use model.dtype=float32 on this machine"
        )
    return warnings


def model_sources(cfg: Config) -> list[tuple[str, str]]:
    """(config key, value) of every model the run loads from a name: the policy, its tokenizer, the teacher, the
    reward models."""
    sources = [("model.name_or_path", cfg.model.name_or_path)]
    if cfg.model.tokenizer is not None:
        sources.append(("model.tokenizer", cfg.model.tokenizer))
    if cfg.teacher is not None:
        sources.append(("teacher.name_or_path", cfg.teacher.name_or_path))
    sources += [(f"rewards.{i}.model.path", r.model.path) for i, r in enumerate(cfg.rewards) if r.model is not None]
    return sources


def check_model_sources(cfg: Config) -> None:
    """Each model the run loads is a built-in, a folder holding a model, or a Hugging Face id: ConfigError naming
    the key for a folder that does not exist or holds no model, before anything loads (Hugging Face would say
    `Repo id must be in the form ...` for a missing path, after the policy had loaded). A well-formed hub id is
    left to the download, which may need the network."""
    from . import in_memory
    from .builtin import MODELS, PREFIX, is_builtin

    for key, name in model_sources(cfg):
        if in_memory.is_reference(name):
            continue
        if is_builtin(name):
            if name.removeprefix(PREFIX) not in MODELS:
                raise ConfigError(
                    f"{key}: unknown built-in model {name!r}; the built-ins are "
                    + ", ".join(f"'{PREFIX}{n}'" for n in MODELS)
                )
            continue
        path = os.path.expanduser(name)
        if os.path.isdir(path):
            wanted = "tokenizer_config.json" if key == "model.tokenizer" else "config.json"
            if not os.path.isfile(os.path.join(path, wanted)) and not _holds_model(path, key):
                raise ConfigError(f"{key}: {name} is a folder without a model (no {wanted} in it)")
            continue
        if os.path.exists(path):
            raise ConfigError(f"{key}: {name} is a file; name the folder that holds the model (its config.json)")
        if not _hub_id(name):
            raise ConfigError(f"{key}: {name}: no such folder (and not a Hugging Face model id such as org/name)")


def check_lora_targets_early(cfg: Config) -> None:
    """model.lora.target_modules against the model's modules, on a skeleton built from its config.json without
    weights (meta device), so a name the model lacks is refused before it loads; skipped where the config cannot
    be read here (a hub id offline: the load checks it again, models.check_lora_targets)."""
    from . import in_memory

    lora, name = cfg.model.lora, cfg.model.name_or_path
    if lora is None or isinstance(lora.target_modules, str) or in_memory.is_reference(name):
        return
    try:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from .builtin import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=cfg.model.trust_remote_code)
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:  # offline, an unusual model class: loading the model says what is wrong
        return
    from .models import check_lora_targets

    check_lora_targets(skeleton, lora.target_modules, name)


def _holds_model(path: str, key: str) -> bool:
    """Other files that make a folder loadable: a PEFT adapter (from_pretrained loads its base), a tokenizer folder
    with only tokenizer.json or a sentencepiece model."""
    files = (
        ("tokenizer.json", "tokenizer.model", "vocab.json") if key == "model.tokenizer" else ("adapter_config.json",)
    )
    return any(os.path.isfile(os.path.join(path, f)) for f in files)


def _hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _runs_on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def cpu_has_bf16_instructions(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 avx512_bf16 or AMX; Arm's bf16). Without, PyTorch
    converts to float32 and back around every kernel. True when /proc/cpuinfo cannot be read: no false alarm."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return True
    flags = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) or not flags


def run_preflight(cfg: Config) -> None:
    """`preflight`, with its warnings logged, then the servers (what `train` does before anything loads)."""
    for warning in preflight(cfg):
        logger.warning("%s", warning)
    check_environment(cfg, contact_server=True)  # environment.url: the server answers, before anything loads
    if engine_kind(cfg.rollout.engine).vllm_servers:
        from .rollout.vllm_server import check_servers

        check_servers(cfg.rollout.vllm_server, log=logger.info)


def _check_vllm_can_run(cfg: Config) -> None:
    """vLLM's CPU build supports a fixed set of attention head sizes; say so before it starts, not from deep
    inside its engine. (On GPUs vLLM chooses among several backends itself.)"""
    import torch

    if torch.cuda.is_available():
        return
    head_dim = model_head_dim(cfg)
    if head_dim is None:
        return
    supported = _vllm_cpu_head_sizes()
    if head_dim not in supported:
        raise ConfigError(
            f"rollout.engine: vLLM's CPU build cannot run {cfg.model.name_or_path!r} (attention head size {head_dim}; "
            f"it supports {', '.join(map(str, supported))}); use rollout.engine=hf on this machine"
        )


def model_head_dim(cfg: Config) -> int | None:
    """The model's attention head size from its config.json, or None when the config cannot be read here."""
    from .builtin import resolve_model_path

    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            resolve_model_path(cfg.model.name_or_path), trust_remote_code=cfg.model.trust_remote_code
        )
    except Exception:  # a hub id offline, a missing folder: loading the model will say what is wrong
        return None
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def _vllm_cpu_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # vLLM absent (the engine will say so) or moved: the list of the tested version
        return VLLM_CPU_HEAD_SIZES
