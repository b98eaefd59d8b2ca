"""Three pieces of the hf engine's decode loop: copies and slow kernels transformers uses on every token.

Profiled on SmolLM2-135M (30 layers, 9 query heads sharing 3 key/value heads), 16 rows, 64 new
tokens on a 2-core CPU (docs/performance.md), a fifth of decode time went to copying the KV cache,
not to computing with it:

* `DynamicCache` grows each layer's keys and values with `torch.cat`, which copies the whole cache
  on every token (quadratic in the completion length). `reserve_room` swaps its layers for ones
  that write each new token into room set aside after the prefill.
* With a padding mask, transformers' SDPA path repeats every key/value head for each query head it
  serves (`repeat_kv`) before calling the kernel: another copy of the whole cache per layer per
  token. For a single-token query `grouped_query_attention` folds the query heads of a group into
  the query-length axis instead, so each key/value head is read once, in place. Same attention, no
  copy; the result differs from the repeated version only by float rounding (tested).
* On CPU, `nn.Linear` with a few rows (`F.linear(x, W)`, i.e. x @ W^T) ran at 4-5 GB/s of weights read
  here, while the same product computed as (W @ x^T)^T ran at 10-22 GB/s (`scripts/decode_roofline.py`,
  docs/performance.md): for a 16-row decode step, all of the model's weights go through the slow form
  once per token. `decode_kernels` swaps the plain `nn.Linear` layers to the fast form for the loop.

All are used only inside `HFEngine._decode_shared_prompt`; training forwards are untouched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DECODE_ATTENTION = "grpo_trainer_decode_sdpa"


class ReservedLayer(DynamicLayer):
    """One layer's keys and values in a buffer with room for `room` more tokens: appending writes, never copies.

    `keys`/`values` are views of the filled part, as `DynamicLayer` exposes them. Only what the decode
    loop calls is supported: `update`, `get_seq_length`, `get_mask_sizes` (inherited) and `reorder_cache`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        batch, heads, length, dim = keys.shape
        self._key_buffer = keys.new_empty(batch, heads, length + room, dim)
        self._value_buffer = values.new_empty(batch, values.shape[1], length + room, values.shape[-1])
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self.length = length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            raise RuntimeError(f"KV cache room exhausted: {end} tokens, room for {self._key_buffer.shape[-2]}")
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep (or repeat) the rows `beam_idx`: the only copy, made when rows finish, not per token."""
        self._key_buffer = self._key_buffer.index_select(0, beam_idx)
        self._value_buffer = self._value_buffer.index_select(0, beam_idx)
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")


def reserve_room(cache: DynamicCache, room: int) -> bool:
    """Give every layer of a prefilled `cache` room for `room` more tokens; False (cache untouched) if its
    layers are not all plain `DynamicLayer`s (sliding-window or quantized caches keep their own logic)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return False
    cache.layers = [ReservedLayer(layer.keys, layer.values, room) for layer in layers]
    return True


def grouped_query_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA without `repeat_kv` for single-token queries; anything else goes to transformers' own SDPA function.

    query [B, H, 1, D], key/value [B, Hkv, L, D]: query head h reads key/value head h // (H / Hkv), so
    the H / Hkv query heads of one group become that group's "query positions" [B, Hkv, H/Hkv, D].
    All of them sit at the same position, so the [B, 1, 1, L] padding mask applies to each unchanged.
    """
    batch, heads, query_length, dim = query.shape
    kv_heads = key.shape[1]
    if query_length != 1 or kv_heads == heads or dropout or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, grouped_query_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def weight_stationary_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` for a few rows on CPU: (W @ x^T)^T instead of x @ W^T, the same products."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(self.weight, rows.t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


@contextlib.contextmanager
def decode_kernels(model: torch.nn.Module) -> Iterator[None]:
    """For the decode loop: `grouped_query_attention` where the model runs transformers' SDPA, and on CPU
    `weight_stationary_linear` for every plain `nn.Linear` (not subclasses: quantized or LoRA-merged layers
    keep their own forward). Everything is restored on exit, also on error."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    config = getattr(model, "config", None)
    switch_attention = getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation")
    for module in linears:
        module.forward = weight_stationary_linear.__get__(module)
    if switch_attention:
        model.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        if switch_attention:
            model.set_attn_implementation("sdpa")
        for module in linears:
            del module.forward
