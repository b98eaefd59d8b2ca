"""The trainer's current weights as (name, tensor) pairs in Hugging Face checkpoint naming.

Both vLLM engines push weights by name, the way a `from_pretrained` folder names
them (`model.layers.0.self_attn.q_proj.weight`, ...): vLLM's `load_weights` maps
those onto its fused layers (qkv_proj, gate_up_proj) and shards them for tensor
parallelism itself.

A LoRA model (a PeftModel) is pushed merged, without touching the training
model: each LoRA-wrapped layer yields `base_weight + delta` computed into a new
tensor (PEFT's `get_delta_weight`, the same formula `merge_and_unload` uses), and
the adapter tensors themselves are skipped. Names lose PEFT's `base_model.model.`
prefix and its `.base_layer.` infix; `modules_to_save` copies replace the
originals.

Not handled here: parameters sharded across ranks (FSDP, ZeRO-3). The caller
must gather them first (e.g. `deepspeed.zero.GatheredParameters`,
`FSDP.summon_full_params`) and call this inside that context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ..models import is_lora

PEFT_PREFIX = "base_model.model."


def _lora_delta(module: torch.nn.Module) -> torch.Tensor | None:
    """The summed delta of the active, unmerged adapters of one LoRA layer (None if none)."""
    active = getattr(module, "active_adapters", None) or []
    merged = set(getattr(module, "merged_adapters", []) or [])
    if getattr(module, "disable_adapters", False):
        return None
    delta = None
    for name in active:
        if name in merged or name not in getattr(module, "lora_A", {}):
            continue
        d = module.get_delta_weight(name)
        delta = d if delta is None else delta + d
    return delta


def _clean_name(name: str) -> str | None:
    """PEFT state names -> checkpoint names; None for adapter-only tensors."""
    name = name.removeprefix(PEFT_PREFIX)
    if ".lora_" in name or ".original_module." in name:
        return None
    name = name.replace(".base_layer.", ".")
    if ".modules_to_save." in name:
        head, _, tail = name.partition(".modules_to_save.")
        name = head + "." + tail.split(".", 1)[1]
    return name


@torch.no_grad()
def iter_merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) for every weight of `model`, LoRA merged; tied weights once.

    Tensors are detached views of the live parameters (no copy) except merged LoRA
    layers, which are fresh tensors. Consume them before the next optimizer step.
    """
    if not is_lora(model):
        seen: set[int] = set()
        for name, tensor in model.state_dict(keep_vars=False).items():
            ptr = tensor.data_ptr()
            if ptr in seen:  # tied (lm_head = embed_tokens): vLLM re-ties them itself
                continue
            seen.add(ptr)
            yield name, tensor.detach()
        return

    merged: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight"):
            base = module.base_layer.weight
            delta = _lora_delta(module)
            weight = base.detach() if delta is None else (base + delta.to(base.dtype)).detach()
            merged[module_name + ".base_layer.weight"] = weight
    seen = set()
    emitted: set[str] = set()
    # modules_to_save copies first, so they win over the original module's tensors.
    items = sorted(model.state_dict().items(), key=lambda kv: ".modules_to_save." not in kv[0])
    for raw_name, tensor in items:
        clean = _clean_name(raw_name)
        if clean is None or clean in emitted:
            continue
        value = merged.get(raw_name, tensor)
        if raw_name not in merged:
            ptr = tensor.data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
        emitted.add(clean)
        yield clean, value.detach()


def save_weights(model: torch.nn.Module, folder: str | Path, filename: str = "model.safetensors") -> Path:
    """Write the merged weights as one safetensors file (atomically: temp file + rename); return its path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in iter_merged_weights(model)}
    path = folder / filename
    tmp = folder / (filename + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- inside vLLM's workers


def _tied_groups(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str, int]]]:
    """Parameters shared by several modules (tied embeddings): [(module, attr, id(param)), ...] per group."""
    where: dict[int, list[tuple[torch.nn.Module, str, int]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            where.setdefault(id(param), []).append((module, attr, id(param)))
    return [group for group in where.values() if len(group) > 1]


def _retie(groups) -> None:
    """Re-share each group's parameter and rebuild the kernels derived from it.

    The tied layer the loader skipped (lm_head) kept its kernel-format weights from
    before (on CPU: a packed GEMM copy made at load time), so every layer of the
    group gets its `process_weights_after_loading` run again (unquantized layers
    only: re-processing quantized ones is not safe).
    """
    for group in groups:
        current = [getattr(module, attr) for module, attr, _ in group]
        fresh = [p for p, (_, _, old_id) in zip(current, group) if id(p) != old_id]
        shared = fresh[0] if fresh else current[0]
        for module, attr, _ in group:
            if getattr(module, attr) is not shared:
                setattr(module, attr, shared)
            method = getattr(module, "quant_method", None)
            if type(method).__name__.startswith("Unquantized") and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


class WorkerWeightSync:
    """A vLLM worker extension: in-place weight reload that keeps tied weights tied.

    Loaded by vLLM into every worker with `worker_extension_cls=
    "grpo_trainer.rollout.weight_sync.WorkerWeightSync"` (the `LLM(...)` argument, or
    `vllm serve --worker-extension-cls ...`), and called through `collective_rpc`
    ("grpo_reload_weights"), also as `POST /collective_rpc` on a dev-mode server.

    Why: vLLM 0.32's `reload_weights` (its layer-wise in-place reload, the only path
    that re-runs the CPU/GPU kernel-format processing of the weights) re-creates the
    parameters of the layers it loads; a tied `lm_head`, which the model's loader
    skips, is put back with its old tensor and silently keeps the old weights. Here
    the tie is recorded before and restored after. Plain `model.load_weights` is not
    an option: on CPU the linear layers' weights are repacked after loading and lose
    their `weight_loader`.
    """

    def grpo_reload_weights(self, weights_path: str | None = None, weights=None) -> bool:
        model = self.model_runner.get_model()
        groups = _tied_groups(model)
        self.reload_weights(weights_iterator=None if weights is None else iter(weights), weights_path=weights_path)
        _retie(groups)
        return True
