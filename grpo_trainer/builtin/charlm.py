"""The family both tiny built-in models belong to: a character tokenizer, a ChatML template, a small Llama.

Every printable ASCII character and newline is one token (anything else is `<|unk|>`), so the models need no
trained tokenizer and work offline. The models differ only in shape (`char_llama_config(tokenizer, **shape)`)
and in their warm starts (tiny.py, tiny_tools.py). Llama rather than Qwen2: transformers 5 forces its Qwen2
tokenizer class on any `qwen2` config, which would re-tokenize the character vocabulary as byte-level BPE.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..deepspeed_guard import deepspeed_left_unimported

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]

# A Qwen-style (ChatML) template, so the tiny models are formatted like the real models users train.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def next_turn_text(role: str, content: str) -> str:
    """The template's tokens between the EOS that ends an assistant turn and the next assistant turn, when a
    `role` message (a tool's result, an environment's answer) comes between them."""
    return f"\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n"


def build_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """The character tokenizer (99 tokens; EOS `<|im_end|>`, padding `<|endoftext|>` on the left)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE with no merges is a character-level model; Fuse joins characters back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=256,
        padding_side="left",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def char_llama_config(tokenizer, **shape):
    """A small Llama config for the character tokenizer; `shape` sets or overrides any LlamaConfig field."""
    from transformers import LlamaConfig

    defaults = dict(
        vocab_size=128,  # 99 tokens used; a round size keeps matmuls aligned
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**defaults, **shape})


def build_char_model(
    folder: Path, tokenizer, shape: dict, seed: int, warm_start: Callable[[Any], None], **config_json: float
) -> None:
    """The one builder of both tiny models: a Llama of `shape` for `tokenizer`, initialised from `seed`, trained by
    `warm_start(model)` under the same seed (torch's global random state is left as it was), saved into `folder`."""
    import torch
    from transformers import LlamaForCausalLM

    config = char_llama_config(tokenizer, **shape)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        warm_start(model)
    save_char_model(model, tokenizer, folder, **config_json)


def save_char_model(model, tokenizer, folder: Path, **config_json: float) -> None:
    """save_pretrained of a warm-started model and its tokenizer, loadable by transformers 4.x and 5.x and vLLM.

    Sampling defaults go into its generation config. `config_json` entries are written into config.json
    where transformers 4.x reads them (transformers 5 moves some, e.g. `rope_theta`, into `rope_parameters`).
    """
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    with deepspeed_left_unimported():  # a built-in model is assembled inside the user's (often DeepSpeed-free) run
        model.save_pretrained(folder)
    # A warm start that tokenizes padded batches leaves padding switched on in the backend, and tokenizer.json
    # would keep it (a loaded tokenizer then pads until its first call without padding): saved as built.
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.save_pretrained(folder)
    # transformers 5 writes `TokenizersBackend`, which 4.x does not know, and keeps the template in a side
    # file that older loaders (and some servers) do not read: name the generic class, inline the template.
    _update_json(
        folder / "tokenizer_config.json",
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=tokenizer.chat_template,
    )
    if config_json:
        _update_json(folder / "config.json", **config_json)


def _update_json(path: Path, **values) -> None:
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
