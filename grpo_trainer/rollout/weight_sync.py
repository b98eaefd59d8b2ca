"""The trainer's current weights as (name, tensor) pairs in Hugging Face checkpoint naming.

Every weight push (both vLLM engines, every transport) goes through `MergedWeights`: the
weights by name, the way a `from_pretrained` folder names them
(`model.layers.0.self_attn.q_proj.weight`, ...), so vLLM's `load_weights` maps them
onto its fused layers (qkv_proj, gate_up_proj) and shards them for tensor
parallelism itself.

- Two channels, as vLLM's `WeightSource`: `metadata()` declares every (name, dtype,
  full shape) without computing or gathering anything; iteration then yields the
  tensors one at a time, in the same order. A transport sizes its buffers from the
  first and streams the second, so a push never holds a second copy of the model.
- A LoRA model (a PeftModel) is pushed merged, without touching the training
  model: each LoRA-wrapped layer yields `base_weight + delta`, computed into a new
  tensor only when its turn comes (PEFT's `get_delta_weight`, the formula
  `merge_and_unload` uses); the adapter tensors themselves are skipped. Names lose
  PEFT's `base_model.model.` prefix and its `.base_layer.` infix;
  `modules_to_save` copies replace the originals.
- Tied weights (lm_head = embed_tokens) are yielded once; vLLM re-ties them
  (see `WorkerWeightSync` and the gloo backend for the CPU case where it does not).
- Sharded parameters (ZeRO-3): pass `gather`, a function of a list of parameters
  returning a context in which they are whole (`zero3_gather`). The weights are
  then gathered one piece at a time, a piece being one decoder layer (or the
  embeddings, or the head), and released before the next: every rank holds at
  most one layer's full weights, not the model. Every rank must iterate (the
  gathers are collectives), in the same order; only one of them sends.
  FSDP is not handled here: gather with `FSDP.summon_full_params` first.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..models import is_lora

PEFT_PREFIX = "base_model.model."

Gather = Callable[[list[torch.nn.Parameter]], AbstractContextManager]  # makes the given parameters whole while open


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


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


@dataclass(frozen=True)
class ParamMeta:
    """One pushed tensor as declared before it is sent (the fields of vLLM's own `ParamMeta`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Entry:
    name: str  # the checkpoint name the server loads it under
    tensor: torch.Tensor  # the live parameter or buffer (under ZeRO-3: a partitioned placeholder until gathered)
    lora: torch.nn.Module | None = None  # the LoRA layer whose active adapters are merged into it on the way out

    def meta(self) -> ParamMeta:
        shape = getattr(self.tensor, "ds_shape", None) or self.tensor.shape  # ZeRO-3 keeps the full shape aside
        return ParamMeta(self.name, self.tensor.dtype, tuple(int(d) for d in shape))

    def parameters(self) -> list[torch.nn.Parameter]:
        """What must be whole to compute this tensor: itself, or the LoRA layer's base weight and adapters."""
        own = self.lora.parameters() if self.lora is not None else [self.tensor]
        return [p for p in own if isinstance(p, torch.nn.Parameter)]

    def value(self) -> torch.Tensor:
        if self.lora is None:
            return self.tensor.detach()
        delta = _lora_delta(self.lora)
        return self.tensor.detach() if delta is None else (self.tensor + delta.to(self.tensor.dtype)).detach()


def _entries(model: torch.nn.Module) -> list[_Entry]:
    """Every tensor to push, in state-dict order, each once (a tied weight under its first name)."""
    state = model.state_dict(keep_vars=True)
    peft = is_lora(model)
    chosen: dict[str, str] = {}  # checkpoint name -> the state-dict name it is read from
    for raw_name in state:
        clean = _clean_name(raw_name) if peft else raw_name
        if clean is not None and (clean not in chosen or ".modules_to_save." in raw_name):
            chosen[clean] = raw_name  # a modules_to_save copy replaces the original module's tensor
    order = {raw_name: i for i, raw_name in enumerate(state)}
    entries: list[_Entry] = []
    seen: set[int] = set()  # a tied lm_head is the embedding's very Parameter: pushed once
    for clean, raw_name in sorted(chosen.items(), key=lambda kv: order[kv[1]]):
        tensor = state[raw_name]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        lora = None
        if peft and raw_name.endswith(".base_layer.weight"):
            owner = model.get_submodule(raw_name.removesuffix(".base_layer.weight"))
            lora = owner if _is_lora_layer(owner) else None
        entries.append(_Entry(clean, tensor, lora))
    return entries


def _layer_key(name: str) -> str | None:
    """`model.layers.3.mlp.up_proj.weight` -> `model.layers.3`: the piece a tensor is gathered with."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


class MergedWeights:
    """The weights a server should hold, declared (`metadata`) and then streamed (iteration); see the module
    docstring. Same interface as vLLM's `WeightSource`, so vLLM's own trainer-side transfer engines take it."""

    def __init__(self, model: torch.nn.Module, gather: Gather | None = None):
        self.model = model
        self.gather = gather
        self._entries = _entries(model)

    def metadata(self) -> list[ParamMeta]:
        return [e.meta() for e in self._entries]

    def pieces(self) -> list[list[_Entry]]:
        """Consecutive entries of one decoder layer (or one run of layer-less tensors): the unit of gathering."""
        pieces: list[list[_Entry]] = []
        for entry in self._entries:
            key = _layer_key(entry.name)
            if pieces and _layer_key(pieces[-1][0].name) == key:
                pieces[-1].append(entry)
            else:
                pieces.append([entry])
        return pieces

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs. Without `gather`: views of the live parameters (merged LoRA weights are fresh
        tensors); use them before the next optimizer step. With `gather`: copies, since a gathered piece is
        released (its memory possibly reused for the next one) before a consumer that buffers is done with it."""
        for piece in self.pieces():
            params = [p for entry in piece for p in entry.parameters()]
            if self.gather is None or not params:
                for entry in piece:
                    yield entry.name, entry.value()
                continue
            with self.gather(params):
                values = [(entry.name, entry.value().clone()) for entry in piece]
            yield from values  # one piece (a decoder layer) at a time


def iter_merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) for every weight of `model`, LoRA merged; tied weights once.

    Tensors are detached views of the live parameters (no copy) except merged LoRA
    layers, which are fresh tensors. Consume them before the next optimizer step.
    """
    with torch.no_grad():
        yield from MergedWeights(model)


def zero3_gather(accelerator) -> Gather | None:
    """The `gather` for `MergedWeights` (and the engines' `sync_weights`) under DeepSpeed ZeRO-3, None elsewhere.

    For the trainer's weight push: `engine.sync_weights(model, version, gather=zero3_gather(accelerator))` on
    every rank, instead of gathering the whole model first (`distributed.gathered_if_zero3`), holds one
    decoder layer's full weights at a time."""
    from ..distributed import zero_stage

    if zero_stage(accelerator) != 3:
        return None
    import deepspeed

    return lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def address_towards(host: str) -> str:
    """This machine's address on the interface that reaches `host`: where the servers find the transfer group."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: nothing is sent, the kernel just picks the route
        return s.getsockname()[0]


def save_weights(
    model: torch.nn.Module, folder: str | Path, filename: str = "model.safetensors", gather: Gather | None = None
) -> Path:
    """Write the merged weights as one safetensors file (atomically: temp file + rename); return its path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        # Gathered tensors are released with their piece: copy them out; plain ones are written from place.
        state = {name: t.to("cpu", copy=gather is not None).contiguous() for name, t in MergedWeights(model, gather)}
    path = folder / filename
    tmp = folder / (filename + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------- inside vLLM's workers


def tied_parameter_groups(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str, int]]]:
    """Parameters shared by several modules (tied embeddings): [(module, attr, id(param)), ...] per group."""
    where: dict[int, list[tuple[torch.nn.Module, str, int]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            where.setdefault(id(param), []).append((module, attr, id(param)))
    return [group for group in where.values() if len(group) > 1]


def retie(groups) -> None:
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
            if (
                method is not None
                and type(method).__name__.startswith("Unquantized")
                and hasattr(method, "process_weights_after_loading")
            ):
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

    if TYPE_CHECKING:  # the vLLM worker's, which this class is mixed into (vLLM refuses a name the worker has)
        model_runner: Any

        def reload_weights(self, *, weights_iterator: Iterator[Any] | None, weights_path: str | None) -> None: ...

    def grpo_reload_weights(self, weights_path: str | None = None, weights=None) -> bool:
        model = self.model_runner.get_model()
        groups = tied_parameter_groups(model)
        self.reload_weights(weights_iterator=None if weights is None else iter(weights), weights_path=weights_path)
        retie(groups)
        return True
