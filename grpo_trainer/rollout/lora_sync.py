"""LoRA adapter-only weight pushes to vLLM (`rollout.lora_sync`): what decides them, and the adapter folders.

A LoRA run's base weights never change, so a vLLM engine that holds them needs only the adapter after each
step: for a 7B model in bf16 with rank 16 on every linear layer ~81 MB instead of ~15 GB (docs/lora.md).
`merged` (the default) pushes base + delta as full weights (weight_sync.MergedWeights); `adapter` pushes the
adapter, and refuses a set-up where vLLM cannot take it; `auto` pushes the adapter where every condition
below holds, else merged weights, with one logged reason.

Conditions (`adapter_refusal`), checked when the engine is built, before vLLM starts:
- the model has LoRA adapters (`model.lora`);
- no FSDP: the adapter's tensors are gathered for the ZeRO-3 case only;
- the rank is at most vLLM's largest `max_lora_rank` (512); vLLM is started with the config's rank rounded up
  to one of its allowed values (`vllm_lora_rank`);
- not a mixture of experts: vLLM's MoE LoRA differs from PEFT's (and raises NotImplementedError on CPU);
- embedding or head targets (`embed_tokens`, `lm_head`) only on a model class vLLM gives embedding LoRA
  (Llama and Qwen3 do, Qwen2 does not);
- servers (`vllm_server`): a `weights_dir` the servers can read (a folder is the only way an adapter reaches
  vLLM 0.32: there is no in-memory path, and the weight-transfer API has no LoRA).
What only a server can tell (started without `--enable-lora`, without `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`,
which vLLM refuses with several API servers; a folder it cannot read; a rank above its `--max-lora-rank`) is
found by the first push, the one made at start: under `auto` the run then falls back to merged pushes for
good, with the server's answer as the reason (vllm_server.py).

Each push writes the adapter as a new version folder (`AdapterFolders`, atomically: written under a temporary
name, then renamed) and loads it into vLLM under a new name (and colocated, a new integer id): vLLM caches
adapters by name and id, and a name loaded again with new weights may keep serving the old ones (or, with
`load_inplace`, re-read the folder on every step, vLLM #33791). The adapters older than the newest
`adapter_slots(K) - 1` are unloaded after the new one is loaded (K = rollout.max_staleness): vLLM answers a request
for an unloaded adapter with an error, not a sample, and although the rollout queue never lets its own requests
outlive a push (it waits for each generation before pushing), a request that outlives its call (a client that gave
up on a slow answer) may still name one of the K before. The names carry a random token per engine and end in
their version (`-v<n>`), so a server that outlives a run (or a resumed run) never sees a name twice, and every rank
can tell the newest one (`newest_adapter`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .engines import lora_config_refusal, vllm_lora_rank

if TYPE_CHECKING:
    import torch

    from ..config import Config
    from .weight_sync import Gather

logger = logging.getLogger(__name__)

EMBEDDING_TARGETS = ("embed_tokens", "lm_head")  # PEFT targets vLLM serves only where the model class declares them
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # HF config fields of MoE models
ADAPTER_PREFIX = "grpo-lora-"  # the names of the adapters this package loads: other adapters on a server are left alone


def adapter_slots(max_staleness: int = 0) -> int:
    """Adapters vLLM holds at once (`--max-loras`): the current one, the K before it that requests sent under
    rollout.max_staleness K may still name, and the new one while it is loaded, before the oldest is unloaded."""
    return max_staleness + 2


def newest_adapter(names: list[str]) -> str | None:
    """The newest of our adapter names (the highest `-v<n>`), None where there is none."""
    versions = {name: _version(name) for name in names if name.startswith(ADAPTER_PREFIX)}
    numbered = {name: v for name, v in versions.items() if v is not None}
    return max(numbered, key=lambda name: numbered[name]) if numbered else None


def stale_adapters(held: list[str], loaded: Adapter, keep: int) -> list[str]:
    """Of the adapters a server holds, those to unload once `loaded` is: every one of ours but `loaded` and the
    `keep - 1` versions before it of the same engine (requests in flight may name those), and any that another
    run (another token) left."""
    own = loaded.name.rsplit("-v", 1)[0] + "-v"
    kept = {f"{own}{v}" for v in range(loaded.lora_id - keep + 1, loaded.lora_id + 1)}
    return [name for name in held if name.startswith(ADAPTER_PREFIX) and name not in kept]


def _version(name: str) -> int | None:
    number = name.rsplit("-v", 1)[-1]
    return int(number) if "-v" in name and number.isdigit() else None


@dataclass(frozen=True)
class ModelFacts:
    """What the decision reads from the model's config: its architecture, and whether it is a mixture of experts."""

    architecture: str
    moe: bool

    @classmethod
    def of(cls, hf_config) -> ModelFacts:
        architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
        return cls(architecture, any((getattr(hf_config, key, 0) or 0) > 1 for key in MOE_KEYS))


def vllm_embedding_lora(architecture: str) -> bool | None:
    """Whether vLLM's model class for `architecture` declares embedding/head LoRA (its `embedding_modules`); None:
    unknown (vLLM is not installed here, or has no class of that name). Asked only for embedding/head targets:
    importing vLLM's model registry takes seconds."""
    try:
        from vllm.model_executor.models import ModelRegistry
    except ImportError:
        return None
    model_cls = ModelRegistry._try_load_model_cls(architecture)  # vLLM's own lookup; None for an unknown name
    return None if model_cls is None else bool(getattr(model_cls, "embedding_modules", None))


def config_refusal(cfg: Config) -> str | None:
    """Why vLLM cannot take this run's adapter, as far as the config alone tells (engines.lora_config_refusal)."""
    lora = cfg.model.lora
    return lora_config_refusal(
        None if lora is None else lora.r, cfg.rollout.engine, cfg.rollout.vllm_server.weights_dir
    )


def adapter_refusal(cfg: Config, facts: ModelFacts, *, fsdp: bool) -> str | None:
    """Why vLLM cannot take this run's adapter (one line naming the key to change), or None if it can."""
    lora = cfg.model.lora
    if lora is None or vllm_lora_rank(lora.r) is None:
        return config_refusal(cfg)
    if fsdp:
        return "FSDP: only DeepSpeed ZeRO-3's adapter tensors are gathered for a push"
    if facts.moe:
        return f"{facts.architecture} is a mixture of experts: vLLM's MoE LoRA does not match PEFT's"
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else lora.target_modules
    embedding = [t for t in targets if t in EMBEDDING_TARGETS]
    supported = vllm_embedding_lora(facts.architecture) if embedding else True
    if not supported:
        why = "vLLM is not installed here to check" if supported is None else "vLLM has no embedding LoRA for it"
        return f"model.lora.target_modules has {', '.join(embedding)} on {facts.architecture}: {why}"
    return config_refusal(cfg)


def push_adapters(cfg: Config, model: torch.nn.Module, *, fsdp: bool | None = None) -> bool:
    """Whether this run pushes adapters (True) or merged weights (False), per `rollout.lora_sync`: `adapter` refuses
    what vLLM cannot take (ConfigError naming the reason), `auto` logs the reason and pushes merged weights.
    `model`: the trainer's (its config says the architecture); `fsdp`: None reads Accelerate's launch setting."""
    mode = cfg.rollout.lora_sync
    if mode == "merged" or (mode == "auto" and cfg.model.lora is None):
        return False
    if fsdp is None:
        fsdp = (
            os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        )  # as distributed.check_distributed_setup
    reason = adapter_refusal(cfg, ModelFacts.of(model.config), fsdp=fsdp)
    if reason is None:
        return True
    if mode == "adapter":
        raise ConfigError(f"rollout.lora_sync=adapter: {reason} (rollout.lora_sync=auto pushes merged weights instead)")
    log_fallback(reason)
    return False


def log_fallback(reason: str) -> None:
    """The one line a run with `rollout.lora_sync=auto` logs when it pushes merged weights."""
    logger.warning("rollout.lora_sync=auto: pushing merged weights, not the LoRA adapter: %s", reason)


# ----------------------------------------------------------------------------- adapter folders


@dataclass(frozen=True)
class Adapter:
    """One pushed adapter version: the name (and, colocated, the integer id) vLLM knows it by, and its folder."""

    name: str
    lora_id: int
    path: Path


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter's own parameters (what a ZeRO-3 push gathers: never the base weights)."""
    return [p for name, p in model.named_parameters() if ".lora_" in name]


class AdapterFolders:
    """Versions of the trainer's adapter as PEFT folders under `root`, each a new name; the newest `keep` kept (the
    current one, which a restarted server loads again, and those before it that vLLM may be reading still)."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep
        self.token = secrets.token_hex(4)  # a name is never reused, even by another run on the same server
        self.count = 0
        self.current: Adapter | None = None

    def write(self, model: torch.nn.Module, gather: Gather | None = None, *, write: bool = True) -> Adapter:
        """The adapter of `model` (a PeftModel) as the next version. Under ZeRO-3 (`gather`) only the adapter's
        tensors are gathered, and every rank must call it; `write=False` on ranks that only take part."""
        import torch
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        from ..models import is_lora

        if not is_lora(model):
            raise ConfigError("rollout.lora_sync: the model to push has no LoRA adapters (model.lora)")
        self.count += 1
        adapter = Adapter(
            f"{ADAPTER_PREFIX}{self.token}-v{self.count}", self.count, self.root / f"v{self.count}-{self.token}"
        )
        params = adapter_parameters(model)
        with torch.no_grad(), gather(params) if gather is not None else contextlib.nullcontext():
            state = {
                k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()
            }
        if write:
            tmp = self.root / f".{adapter.path.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            model.peft_config[model.active_adapter].save_pretrained(str(tmp))
            tmp.rename(adapter.path)  # vLLM never sees a half-written folder
            self._remove_older_than(adapter.lora_id - self.keep + 1)
        self.current = adapter
        return adapter

    def _remove_older_than(self, keep_from: int) -> None:
        for folder in self.root.glob(f"v*-{self.token}"):
            version = folder.name.split("-", 1)[0][1:]
            if version.isdigit() and int(version) < keep_from:
                shutil.rmtree(folder, ignore_errors=True)
