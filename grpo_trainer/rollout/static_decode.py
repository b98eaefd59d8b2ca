"""A compiled decode step for the hf engine: torch.compile over a static KV cache (`rollout.hf.compile`).

The eager decode loop (hf.py with decode.py's kernels) pays Python and dispatch overhead for every one of a
model's ~15 small kernels per layer per token, and grows shapes by one token per step. Compiling needs static
shapes, so here:

* the KV cache is transformers' `StaticCache`: every layer holds [rows, kv heads, length, head dim] for the
  whole completion, `length` rounded up to a power of two (prompts of different lengths reuse one graph);
* the row count is bucketed in powers of two: as completions finish, the live rows move to the front of the
  bucket, and the cache shrinks to the next power of two once they fit (16, 8, 4, 2, 1), so a group of 16
  compiles at most 5 graphs per cache length. Rows past the live ones are copies of a live row, computed and
  ignored (the weights are read once per step whatever the rows; padding rows cost little).

Compiling costs minutes on a small CPU (measured in docs/performance.md, where it also did not make the step
faster there), once per process (inductor's on-disk cache shortens later starts); on a GPU it is the
standard cure for per-token launch overhead (`rollout.hf.compile_mode: reduce-overhead` adds CUDA graphs).
Logits equal the eager loop's up to float rounding (fused kernels sum in another order; tested), so
sampled tokens may differ from the eager loop's for the same seed.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache

from .kernels import length_bucket, row_bucket


class CompiledForward:
    """A model's forward under torch.compile, kept for the model's life: graphs are reused across generate calls.
    Parameters are graph inputs, not constants, so optimizer steps between rollouts are seen without recompiling."""

    def __init__(self, model: torch.nn.Module, mode: str | None = None, backend: str = "inductor"):
        """`backend`: torch.compile's; "eager" traces the same static graphs without generating kernels (seconds,
        not minutes, on a small CPU), which is how the tests check the decoder's cache and bucket logic."""
        self.model = model
        self.forward = torch.compile(model.forward, dynamic=False, mode=mode, backend=backend)


class StaticDecoder:
    """The decode loop's forward over a static cache for the rows of one generate batch.

    Built from the eager prefill's cache (`DynamicCache`, one row per completion) and padding mask [B, P]; then
    `forward(tokens, positions)` gives the next logits of the live rows, and `keep(indices)` drops finished ones.
    """

    def __init__(self, compiled: CompiledForward, prefilled, mask: torch.Tensor, room: int):
        self.compiled, self.config = compiled, compiled.model.config
        self.live, self.prompt_length = mask.shape
        self.length = length_bucket(self.prompt_length + room)
        self.written = 0  # completion tokens in the cache
        bucket = row_bucket(self.live)
        order = _padded(torch.arange(self.live, device=mask.device), bucket)
        self.mask = torch.zeros(bucket, self.length, dtype=mask.dtype, device=mask.device)
        self.mask[:, : self.prompt_length] = mask[order]
        self.cache = self._static_cache([(layer.keys[order], layer.values[order]) for layer in prefilled.layers])

    def _static_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> StaticCache:
        """A StaticCache of `self.length` positions holding `layers`' keys and values (same rows, filled part)."""
        cache = StaticCache(config=self.config, max_cache_len=self.length)
        filled = self.prompt_length + self.written
        for layer, (keys, values) in zip(cache.layers, layers):
            layer.lazy_initialization(keys, values)
            layer.keys[:, :, :filled] = keys[:, :, :filled]
            layer.values[:, :, :filled] = values[:, :, :filled]
            layer.cumulative_length.fill_(filled)
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [live, V] after the live rows' next `tokens` [live] at `positions` [live]."""
        bucket = self.mask.shape[0]
        slot = self.prompt_length + self.written
        if slot >= self.length:
            raise RuntimeError(f"static KV cache full: {slot} positions, room for {self.length}")
        self.mask[:, slot] = 1
        order = _padded(torch.arange(len(tokens), device=tokens.device), bucket)
        logits = self.compiled.forward(
            input_ids=tokens[order, None],
            attention_mask=self.mask,
            position_ids=positions[order, None],
            past_key_values=self.cache,
            use_cache=True,
            cache_position=torch.tensor([slot], device=tokens.device),
        ).logits
        self.written += 1
        return logits[: len(tokens), -1]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep the live rows `indices` (in this order); the cache shrinks to their power-of-two bucket."""
        bucket = row_bucket(len(indices))
        order = _padded(indices, bucket)
        self.mask = self.mask[order]
        if bucket == self.cache.layers[0].keys.shape[0]:
            for layer in self.cache.layers:  # in place: the same buffers (CUDA graphs keep their addresses)
                layer.keys.copy_(layer.keys[order])
                layer.values.copy_(layer.values[order])
            return
        self.cache = self._static_cache([(layer.keys[order], layer.values[order]) for layer in self.cache.layers])


def _padded(rows: torch.Tensor, bucket: int) -> torch.Tensor:
    """`rows` followed by copies of its first, to `bucket` entries: padding rows are real rows computed twice
    (an all-padding row would have no key to attend to)."""
    return torch.cat([rows, rows[:1].expand(bucket - len(rows))])
