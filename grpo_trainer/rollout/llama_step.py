"""A Llama decode step without transformers' module machinery: the same operators, in the same order, called
directly; so the same logits bit for bit, at less Python per token.

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


def supports(model: torch.nn.Module) -> bool:
    """Whether `LlamaDecodeStep` can stand in for `model`'s forward (the first step still checks the bits)."""
    if type(model) is not LlamaForCausalLM or model.training or has_hooks(model):
        return False
    return all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)


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


# model -> whether its lean step gave its forward's bits (decided on its first decode step in this process)
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def checked(model: torch.nn.Module) -> bool | None:
    """True/False once `model`'s lean step was compared with its forward in this process; None before."""
    return _CHECKED.get(model)


def record(model: torch.nn.Module, same_bits: bool) -> None:
    _CHECKED[model] = same_bits
