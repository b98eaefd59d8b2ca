"""Loading the policy, reference and tokenizer, and per-token log-probabilities.

`TokenLogprobs` wraps a causal LM so that its forward returns the log-prob of
each completion token (and optionally the entropy) instead of logits. It is the
module handed to `accelerator.prepare`, so DDP/FSDP/DeepSpeed see an ordinary
forward, while the full-vocabulary fp32 logits are only ever built for
`chunk_size` tokens at a time, and never for prompt positions.

Batches hold left-padded prompts (each distinct prompt once) and
right-padded completions, with explicit position ids, the layout `generate`
uses, so the log-probs of training match those of sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import in_memory
from .config import ModelConfig
from .errors import ConfigError
from .builtin import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(cfg: ModelConfig, chat_template: str | None = None):
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.name_or_path
    if in_memory.is_reference(source):  # given to grpo_trainer.train() in Python
        tokenizer = in_memory.tokenizer(source, "model.tokenizer")
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(source), trust_remote_code=cfg.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_causal_lm(cfg: ModelConfig):
    """The model as configured; with LoRA adapters (a PeftModel) when `model.lora` is set."""
    from transformers import AutoModelForCausalLM

    if in_memory.is_reference(cfg.name_or_path):  # given to grpo_trainer.train() in Python
        model = in_memory.model(cfg.name_or_path, "model.name_or_path")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(cfg.name_or_path), dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
        )
    model.config.use_cache = False  # training forwards never need the KV cache
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


def is_lora(lm) -> bool:
    """Whether `lm` is a PEFT model with LoRA adapters: the one test of it in the package (duck-typed, so that
    peft is imported only by runs that use it)."""
    return hasattr(lm, "disable_adapter") and hasattr(lm, "merge_and_unload") and hasattr(lm, "get_base_model")


def base_model(lm):
    """The transformers model under a LoRA model's adapters, or the model itself."""
    return lm.get_base_model() if is_lora(lm) else lm


def eos_token_ids(tokenizer, lm) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def load_policy_weights(lm: torch.nn.Module, weights: Path, base_name: str) -> None:
    """Load the trainer's wrapped-policy state (keys `lm.<name>`) into the bare model, strictly."""
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(str(weights), map_location="cpu", weights_only=True)
    if any(key.startswith("lm.") for key in state):
        state = {key.removeprefix("lm."): value for key, value in state.items()}
    missing, unexpected = lm.load_state_dict(state, strict=False)
    # Tied weights (lm_head = embeddings) are saved once; a missing key that shares storage with a loaded one is fine.
    own = lm.state_dict()
    loaded_ptrs = {own[key].data_ptr() for key in state if key in own}
    missing = [key for key in missing if own[key].data_ptr() not in loaded_ptrs]
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint: {weights} does not match model.name_or_path ({base_name!r}): "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
            f"{'...' if len(unexpected) > 3 else ''}; evaluate with the config the run was trained with"
        )


def context_length(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


class TokenLogprobs(nn.Module):
    """A causal LM whose forward gives per-token log-probs of the completion tokens.

    forward(**SequenceBatch.tensors()) -> logprobs [B, C] (fp32), entropy [B, C] or None
    The entropy is a statistic (no gradient) unless `entropy_grad` asks for it (the loss's entropy term):
    its graph holds another [B, C, V] tensor per chunk until the backward pass.
    Tokens are scored at `temperature`, the sampling temperature, so that
    pi_theta here is the distribution the completions were drawn from.

    With `share_prompt`, each distinct prompt of the batch goes through the model
    once and its KV cache is copied to the completions that continue it (G of
    them in a group), which then run on their own tokens only. Attention is
    causal, so this is the same computation as running every prompt+completion
    in full, and gradients reach the prompt positions through the cache. Under
    gradient checkpointing transformers drops the cache, so the full path is used.
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0, chunk_size: int = 1024, share_prompt: bool = True):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.share_prompt = share_prompt
        # FSDP's auto-wrap looks for the transformer block classes on the module it is given.
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompt_index: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = base_model(self.lm)
        decoder = base.get_decoder()
        checkpointing = self.training and getattr(base, "is_gradient_checkpointing", False)
        if self.share_prompt and not checkpointing:
            hidden_states = self._hidden_shared_prompt
        else:
            hidden_states = self._hidden_full
        hidden = hidden_states(decoder, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
        return self._score(base.get_output_embeddings(), hidden, completion_ids, with_entropy, entropy_grad)

    @staticmethod
    def _hidden_full(decoder, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask) -> torch.Tensor:
        """Every row as prompt + completion, [B, P + C], through the model; the C states that predict completion tokens."""
        input_ids = torch.cat([prompt_ids[prompt_index], completion_ids], 1)
        attention_mask = torch.cat([prompt_mask[prompt_index], completion_mask.to(prompt_mask.dtype)], 1)
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask), use_cache=False
        ).last_hidden_state
        c = completion_ids.shape[1]
        return hidden[:, -c - 1 : -1]  # the state at position t predicts token t + 1

    @staticmethod
    def _hidden_shared_prompt(
        decoder, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask
    ) -> torch.Tensor:
        """Prompts [U, P] once, their cache gathered to the B rows, then completions [B, C - 1] on top of it."""
        out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask), use_cache=True)
        first = out.last_hidden_state[prompt_index, -1:]  # [B, 1, H]: predicts completion token 0
        c = completion_ids.shape[1]
        if c == 1:
            return first
        cache = out.past_key_values
        cache.reorder_cache(prompt_index)  # an index_select per layer: differentiable, so gradients flow back
        mask = prompt_mask[prompt_index]
        attention_mask = torch.cat([mask, completion_mask[:, :-1].to(mask.dtype)], 1)
        position_ids = mask.sum(-1, keepdim=True) + torch.arange(c - 1, device=mask.device)
        rest = decoder(
            input_ids=completion_ids[:, :-1],  # the last token predicts nothing we score
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        return torch.cat([first, rest], 1)  # [B, C, H]

    def _score(self, head, hidden, targets, with_entropy, entropy_grad=False):
        """log p(target) (and entropy) from hidden states, `chunk_size` positions of full-vocabulary logits at a time."""
        logps, entropies = [], []
        for start in range(0, targets.shape[1], self.chunk_size):
            stop = start + self.chunk_size
            logits = head(hidden[:, start:stop]).float() / self.temperature  # [B, c, V]
            logp_all = logits.log_softmax(-1)
            logps.append(logp_all.gather(-1, targets[:, start:stop, None]).squeeze(-1))
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    entropies.append(-(logp_all.exp() * logp_all).sum(-1))
        return torch.cat(logps, 1), (torch.cat(entropies, 1) if with_entropy else None)


@dataclass
class SequenceBatch:
    """Completions and the prompts they continue, each distinct prompt held once.

    Prompts are left-padded and completions right-padded to the longest of the
    batch, the layout `generate` uses, so training log-probs match sampling's.
    """

    prompt_ids: torch.Tensor  # [U, P] distinct prompts, left-padded
    prompt_mask: torch.Tensor  # [U, P]
    prompt_index: torch.Tensor  # [B] row of prompt_ids that completion b continues
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] 1.0 for real completion tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.shape[1]

    def tensors(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The keyword arguments of `TokenLogprobs.forward`, on `device`."""
        return {name: getattr(self, name).to(device) for name in self.__dataclass_fields__}


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one [N, P] tensor, and its attention mask: the layout `generate` uses."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, mask


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: each row's first real token is position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def make_sequence_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> SequenceBatch:
    """Row b is prompts[b] followed by completions[b]; identical prompts (a group's) are stored once."""
    distinct: dict[tuple[int, ...], int] = {}
    prompt_index = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    prompt_ids, prompt_mask = left_padded(list(distinct), pad_id)
    c_len = max(max(len(c) for c in completions), 1)
    return SequenceBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        completion_ids=torch.tensor([c + [pad_id] * (c_len - len(c)) for c in completions], dtype=torch.long),
        completion_mask=torch.tensor([[1.0] * len(c) + [0.0] * (c_len - len(c)) for c in completions]),
    )
