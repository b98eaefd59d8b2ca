"""Giving the heap's free memory back to the system where a CPU training step would otherwise keep it resident.

glibc's malloc keeps freed memory in its heap, resident, for the next allocation; it returns to the system only
what is freed at the top of the heap, and blocks above its mmap threshold (128 KiB at first, rising towards
32 MiB as such blocks are freed), which get mappings of their own. A training step on
the CPU frees a lot in the middle of the heap: the rollout's KV cache and reordered weights, a forward pass's
activations, the backward's activation gradients. The next phase then allocates elsewhere in the heap, and the
process's resident memory is, phase after phase, what is in use now plus what any earlier phase left free.
For SmolLM2-135M that is hundreds of MiB above what is in use at every plateau of the step (docs/performance.md,
"Where the peak is").

`HeapTrimmer` calls `malloc_trim(0)`, which hands every whole free page inside the heap back to the system
(madvise), at the points where a phase's peak begins: before a rollout, before each micro-batch's forward and
backward, before the optimizer step, and inside the backward (before the input embeddings' gradient, which
arrives when all the others are held, and every few decoder layers, as activation gradients are freed and
parameter gradients made). A trimmed page that is used again costs a page fault: measured cost and saving in
docs/performance.md. Nothing numeric changes: where a tensor lives does not change what is computed in it.

On when the policy trains on the CPU, its weights fill at least MIN_WEIGHT_BYTES and the C library is glibc
(`train.trim_host_memory`, default: so);
a no-op elsewhere (GPU memory is the caching allocator's business, not malloc's). With another malloc preloaded
(jemalloc, tcmalloc) the call finds glibc's heap nearly empty and does nothing useful.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("grpo_trainer")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim from the C library this process already uses, or None where it has none (musl, macOS).
    Looked up here, not held by the trimmer: a ctypes function cannot be copied, and the trimmer's hooks go
    wherever the model is deep-copied."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """`trimmer()` hands the heap's free pages back (when enabled and possible); `watch_backward` adds the points
    inside a model's backward pass, `unwatch` takes them away again (the model may be the caller's own)."""

    LAYER_STRIDE = 6  # decoder layers between trims in the backward: SmolLM2's 30 layers, 5 trims
    # Below this much of weights the trimmer is off by default: a tiny model's heap is small, while each trim
    # walks the whole process's heap: on a small model its time is a large share of a short step
    # (docs/performance.md, "Where the peak is").
    MIN_WEIGHT_BYTES = 64 * 2**20

    def __init__(self, enabled: bool):
        self.active = enabled and _malloc_trim() is not None
        self.calls = 0
        self._seconds = 0.0  # in malloc_trim since the last take_seconds (not the page faults that follow)
        self._handles: list = []

    @classmethod
    def for_model(cls, asked: bool | None, device_type: str, model: nn.Module) -> HeapTrimmer:
        """`train.trim_host_memory`: as asked, or (None) where `model` trains on the CPU and its weights fill at
        least MIN_WEIGHT_BYTES."""
        if asked is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            return cls(device_type == "cpu" and weight_bytes >= cls.MIN_WEIGHT_BYTES)
        trimmer = cls(asked)
        if asked and not trimmer.active:
            logger.warning(
                "train.trim_host_memory=true, but this C library has no malloc_trim (not glibc): nothing is trimmed"
            )
        return trimmer

    def __call__(self) -> None:
        trim = _malloc_trim() if self.active else None
        if trim is not None:
            started = time.perf_counter()
            trim(0)
            self.calls += 1
            self._seconds += time.perf_counter() - started

    def take_seconds(self) -> float:
        """Seconds spent trimming since the last call (the step's `host_memory/trim_seconds`)."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def watch_backward(self, embeddings: nn.Module, layers: list[nn.Module]) -> None:
        """Trim in the backward when the gradient reaches the input embeddings' output and every LAYER_STRIDE-th
        decoder layer's output. Tensor hooks on the forward's outputs, registered by forward hooks: they add no
        node to the autograd graph, so gradients are summed as before."""
        if self.active:
            watched = [embeddings] + layers[self.LAYER_STRIDE - 1 :: self.LAYER_STRIDE]
            self._handles += [module.register_forward_hook(self._hook_output) for module in watched]

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook_output(self, module, args, output) -> None:
        tensor = output[0] if isinstance(output, tuple) else output  # decoder layers may return (hidden, ...)
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
            tensor.register_hook(self._on_gradient)

    def _on_gradient(self, grad: torch.Tensor) -> None:
        self()
