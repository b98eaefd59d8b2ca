"""A Llama decode step without transformers' module machinery, in two kinds.

`LlamaDecodeStep`: the same operators, in the same order, called directly; so the same logits bit for bit, at
less Python per token (below). `FusedLlamaDecodeStep`: the small operators between the linears as one C call each
(cpu/layer_ops.py); it rounds differently, so the decode plan chooses it by rule (rollout/decode.py).

At 32 rows a SmolLM2 decode step spends ~55 ms in its linears, ~10 ms in small operators and the rest in Python,
part of it transformers' machinery: `nn.Module.__call__` for ~400 modules a step (hook checks, keyword plumbing),
the model's output decorators and dataclasses, the attention function's lookup in every layer. Without it the
step took 82.3 ms against 86.7 (best of 30 alternating reps on machine D; docs/performance.md). `LlamaDecodeStep` walks the
layers itself and calls each module's `forward` (the decode loop's chosen linear forms included: they are the
linears' `forward`), transformers' own RMSNorm, rotary embedding, mask function and attention function, with the
arguments transformers passes them. Nothing is computed differently, and that is checked rather than assumed:
each model's first decode step runs both ways from the same cache and the lean step is used only where the
logits are the same bits (`EagerDecoder` in decode.py). A transformers release that changes the Llama layer
then costs the speed, never the numbers.

Only where skipping `__call__` skips nothing: `LlamaForCausalLM` exactly (no subclass, no adapter wrapping), in
eval mode, without any forward hook on any module or globally (accelerate's device hooks, DeepSpeed's
parameter hooks, PEFT's wrappers), with every decoder layer a plain `LlamaDecoderLayer`.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM


def has_hooks(model: torch.nn.Module) -> bool:
    """Whether calling a module's `forward` directly would skip something `__call__` runs."""
    from torch.nn.modules import module as torch_module

    global_hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    if any(getattr(torch_module, name, None) for name in global_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def plain_llama(model: torch.nn.Module) -> bool:
    """`LlamaForCausalLM` exactly, every decoder layer a plain `LlamaDecoderLayer` (what a plan can decide on)."""
    return type(model) is LlamaForCausalLM and all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)


def supports(model: torch.nn.Module) -> bool:
    """Whether `LlamaDecodeStep` can stand in for `model`'s forward (the first step still checks the bits)."""
    return plain_llama(model) and not model.training and not has_hooks(model)


class LlamaDecodeStep:
    """`model(input_ids=..., attention_mask=..., position_ids=..., past_key_values=cache, use_cache=True).logits[:, -1]`
    for one new token per row, through the same operators without the module machinery around them."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.inner = model.model
        self.config = model.config
        self.layers = list(self.inner.layers[: self.config.num_hidden_layers])
        # The rotary function the layers themselves call (their module's, as they look it up)
        self.apply_rotary = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb

    def __call__(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        inner, config = self.inner, self.config
        hidden = inner.embed_tokens(input_ids)
        mask = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=cache,
            position_ids=position_ids,
        )
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
        for layer in self.layers:
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm.forward(hidden)
            input_shape = hidden.shape[:-1]
            hidden_shape = (*input_shape, -1, attention.head_dim)
            query = attention.q_proj.forward(hidden).view(hidden_shape).transpose(1, 2)
            key = attention.k_proj.forward(hidden).view(hidden_shape).transpose(1, 2)
            value = attention.v_proj.forward(hidden).view(hidden_shape).transpose(1, 2)
            query, key = self.apply_rotary(query, key, cos, sin)
            key, value = cache.update(key, value, attention.layer_idx)
            out, _ = attend(
                attention,
                query,
                key,
                value,
                mask,
                dropout=0.0,
                scaling=attention.scaling,
                position_ids=position_ids,
                use_cache=True,
            )
            out = attention.o_proj.forward(out.reshape(*input_shape, -1).contiguous())
            hidden = residual + out
            residual = hidden
            mlp = layer.mlp
            hidden = layer.post_attention_layernorm.forward(hidden)
            hidden = mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(hidden)) * mlp.up_proj.forward(hidden))
            hidden = residual + hidden
        hidden = inner.norm.forward(hidden)
        return self.model.lm_head.forward(hidden)[:, -1]


class FusedLlamaDecodeStep:
    """The decode step with each group of small operators between two linears as one C call (cpu/layer_ops.py):
    residual add + RMSNorm, rotary + cache write + attention, SiLU x up. The linears are the modules' own
    `forward` (the decode loop's chosen forms). It rounds differently from the modules (a float32 mean of squares
    summed in double, a polynomial exponential), so the decode plan chooses it by rule (decode.py's
    `DecodeKernels.preferred`), never by timing, and records it; not checked against the forward's bits.

    Only where `fits` says so, on a cache with reserved room (decode.ReservedLayer, whose buffers it writes)."""

    def __init__(self, model: LlamaForCausalLM, ops):
        self.model, self.inner, self.ops = model, model.model, ops
        config = model.config
        self.layers = list(self.inner.layers[: config.num_hidden_layers])
        self.heads = config.num_attention_heads
        # each layer's input norm, then the next one's: the final norm closes the last layer
        self.next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.inner.norm]

    @staticmethod
    def fits(model: torch.nn.Module) -> bool:
        """Whether the kernels take this model: a plain Llama (`supports`) with SiLU, float32 on CPU, at most
        attention.MAX_GROUP query heads per key/value head. (Its cache must have reserved room: decode.py checks.)"""
        from transformers.activations import SiLUActivation
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaMLP,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        from ..cpu.attention import MAX_GROUP

        if not supports(model) or torch.is_autocast_enabled("cpu"):
            return False
        config, inner = model.config, model.model
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if config.num_attention_heads % kv_heads or config.num_attention_heads // kv_heads > MAX_GROUP:
            return False
        # What it computes itself instead of calling: exactly transformers' modules, no `forward` set on an instance
        # (accelerate's hooks and other wrappers do that), rotary over the whole head (no partial rotary)
        bypassed = [inner.norm, inner.rotary_emb]
        for layer in inner.layers:
            bypassed += [layer, layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp]
            bypassed.append(layer.mlp.act_fn)
        kinds = (
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
            LlamaDecoderLayer,
            LlamaAttention,
            LlamaMLP,
            SiLUActivation,
            torch.nn.SiLU,
        )
        if any(type(m) not in kinds or "forward" in vars(m) for m in bypassed):
            return False
        if inner.rotary_emb.inv_freq.numel() * 2 != inner.layers[0].self_attn.head_dim:
            return False
        return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())

    @torch.no_grad()  # the kernels write into tensors in place, unseen by autograd
    def __call__(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        ops, inner = self.ops, self.inner
        residual = inner.embed_tokens(input_ids[:, 0])  # [rows, hidden]: a new tensor, the residual stream in place
        cos, sin = inner.rotary_emb(residual, position_ids=position_ids)
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        position = cache.layers[0].length
        cache.layers[0].ensure_room(1)  # every layer has the same room: checked before any is written
        mask = attention_mask[:, : position + 1].to(torch.uint8)
        first = self.layers[0].input_layernorm
        normed = ops.rms_norm(residual, first.weight, first.variance_epsilon)
        for layer, stored, next_norm in zip(self.layers, cache.layers, self.next_norms):
            attention, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            out = ops.rotate_store_attend(
                attention.q_proj.forward(normed),
                attention.k_proj.forward(normed),
                attention.v_proj.forward(normed),
                cos,
                sin,
                self.heads,
                stored._key_buffer,
                stored._value_buffer,
                position,
                mask,
                attention.scaling,
            )
            normed = ops.rms_norm(attention.o_proj.forward(out), norm.weight, norm.variance_epsilon, add=residual)
            activated = ops.swiglu(mlp.gate_proj.forward(normed), mlp.up_proj.forward(normed))
            normed = ops.rms_norm(mlp.down_proj.forward(activated), next_norm.weight, next_norm.variance_epsilon,
                                  add=residual)  # fmt: skip
        for stored in cache.layers:
            stored.advance(1)
        return self.model.lm_head.forward(normed)


# model -> whether its lean step gave its forward's bits (decided on its first decode step in this process)
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def checked(model: torch.nn.Module) -> bool | None:
    """True/False once `model`'s lean step was compared with its forward in this process; None before."""
    return _CHECKED.get(model)


def record(model: torch.nn.Module, same_bits: bool) -> None:
    _CHECKED[model] = same_bits
