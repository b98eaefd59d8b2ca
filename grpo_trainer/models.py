"""Loading the policy, reference and tokenizer, and per-token log-probabilities.

`TokenLogprobs` wraps a causal LM so that its forward returns the log-prob of
each completion token (and optionally the entropy) instead of logits. It is the
module handed to `accelerator.prepare`, so DDP/FSDP/DeepSpeed see an ordinary
forward, while the full-vocabulary fp32 logits are only ever built for
`chunk_size` tokens at a time, and never for prompt positions.

Two batch layouts, the same numbers up to float rounding. `SequenceBatch` holds left-padded prompts (each
distinct prompt once) and right-padded completions, with explicit position ids, the layout `generate` uses, so
the log-probs of training match those of sampling. `PackedBatch` (`train.packing`) holds a prompt once followed
by its completions back to back in one row, with an explicit attention mask and positions that make each
completion see exactly what it saw when sampled: nothing is padded to the longest completion.

Under SDPA, long packed rows run attention segment by segment (packed_attention.py: a prompt against itself, a
completion against its prompt and itself), short ones under one dense mask. Deliberately not done: flex attention
(block-sparse, it would skip the masked blocks that SDPA computes) has no backward on CPU in torch 2.13 and
compiles per shape; nor flash-attention's varlen kernels, which cannot express "the prompt and itself" for a
completion. Packing therefore needs an attention path that takes a 4D mask (sdpa, eager) and full attention in
every layer (`check_packing_support`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import in_memory
from .builtin import resolve_model_path
from .config import ModelConfig
from .cpu import lm_head
from .errors import ConfigError
from .packed_attention import LAYOUT_KEY, SegmentPlan, placeholder_mask, runs_segments

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

        check_lora_targets(model, cfg.lora.target_modules, cfg.name_or_path)
        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        try:
            model = get_peft_model(model, lora)
        except ValueError as exc:  # a target PEFT cannot adapt (`Target module LlamaRMSNorm() is not supported...`)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"model.lora.target_modules: {first}") from None
    return model


def check_lora_targets(model: torch.nn.Module, targets: list[str] | str, name: str) -> None:
    """Each name of model.lora.target_modules matches a module of the model (as PEFT matches a list: the module's
    dotted path is the name or ends with `.name`); ConfigError naming the key and the model's linear layers
    otherwise, instead of PEFT's traceback. (A module PEFT cannot adapt, a norm, is PEFT's ValueError, made one
    line by load_causal_lm.)"""
    if isinstance(targets, str):  # all-linear (config.LoraConfig makes any other string a list)
        return
    modules = dict(model.named_modules())
    linear = sorted(
        {
            path.rsplit(".", 1)[-1]
            for path, m in modules.items()
            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
        }
    )  # Conv1D: transformers' linear layer of GPT-2
    hint = f"{name}'s linear layers: {', '.join(linear)} (or all-linear)"
    for target in targets:
        found = [m for path, m in modules.items() if path == target or path.endswith("." + target)]
        if not found:
            raise ConfigError(f"model.lora.target_modules: {target!r} is not a module of {name}; {hint}")


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


LOGITS_CHUNK_BYTES = 256 * 2**20  # float32 logits scored at a time when `model.logprob_chunk_size` is not set


class TokenLogprobs(nn.Module):
    """A causal LM whose forward gives per-token log-probs of the completion tokens.

    forward(**SequenceBatch.tensors()) or forward(**PackedBatch.tensors())
        -> logprobs [B, C] (fp32), entropy [B, C] or None; 0 where completion b has no token t.
    The entropy is a statistic (no gradient) unless `entropy_grad` asks for it (the loss's entropy term).
    Tokens are scored at `temperature`, the sampling temperature, so that
    pi_theta here is the distribution the completions were drawn from.

    Two layouts of the same computation (the batch chooses, by its tensors):
    - padded (`SequenceBatch`): with `share_prompt`, each distinct prompt of the batch goes through the model
      once and its KV cache is copied to the completions that continue it (G of them in a group), which then
      run on their own tokens only, padded to the longest. Attention is causal, so this is the same
      computation as running every prompt+completion in full, and gradients reach the prompt positions
      through the cache. Under gradient checkpointing transformers drops the cache, so the full path is used.
    - packed (`PackedBatch`, `train.packing`): rows hold a prompt once followed by its completions back to back,
      an explicit attention mask letting each completion see the prompt and itself only. Nothing is padded
      but the slack at the end of a row; works under gradient checkpointing too (no cache).
    """

    def __init__(
        self,
        lm: nn.Module,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        share_prompt: bool = True,
        agree_chunks: Callable[[int], int] | None = None,
    ):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.share_prompt = share_prompt
        # Where every module call gathers sharded weights across ranks (ZeRO-3, FSDP): the largest chunk count of
        # any rank (run.chunk_agreement), so that every rank calls the output head equally often.
        self.agree_chunks = agree_chunks
        # FSDP's auto-wrap looks for the transformer block classes on the module it is given.
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(
        self,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        **layout: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = base_model(self.lm)
        decoder, head = base.get_decoder(), base.get_output_embeddings()
        if "input_ids" in layout:  # PackedBatch
            return self._packed(decoder, head, completion_ids, completion_mask, with_entropy, entropy_grad, **layout)
        checkpointing = self.training and getattr(base, "is_gradient_checkpointing", False)
        args = (
            decoder,
            layout["prompt_ids"],
            layout["prompt_mask"],
            layout["prompt_index"],
            completion_ids,
            completion_mask,
        )
        if self.share_prompt and not checkpointing:
            hidden = self._hidden_shared_prompt(*args, always_two_passes=self.agree_chunks is not None)
        else:
            hidden = self._hidden_full(*args)
        return self._score(head, hidden, completion_ids, with_entropy, entropy_grad)

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
        decoder, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, always_two_passes: bool = False
    ) -> torch.Tensor:
        """Prompts [U, P] once, their cache gathered to the B rows, then completions [B, C - 1] on top of it.

        With one completion position (C = 1) the second pass has nothing to score and is skipped, unless
        `always_two_passes` (ranks that must call every module equally often, ZeRO-3 and FSDP, whose C differ):
        then it runs on that one token and its states are dropped (their gradient is zero)."""
        out = decoder(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask), use_cache=True
        )
        first = out.last_hidden_state[prompt_index, -1:]  # [B, 1, H]: predicts completion token 0
        c = completion_ids.shape[1]
        if c == 1 and not always_two_passes:
            return first
        second = max(c - 1, 1)  # the last token predicts nothing we score
        cache = out.past_key_values
        cache.reorder_cache(prompt_index)  # an index_select per layer: differentiable, so gradients flow back
        mask = prompt_mask[prompt_index]
        attention_mask = torch.cat([mask, completion_mask[:, :second].to(mask.dtype)], 1)
        position_ids = mask.sum(-1, keepdim=True) + torch.arange(second, device=mask.device)
        rest = decoder(
            input_ids=completion_ids[:, :second],
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        return torch.cat([first, rest if c > 1 else rest[:, :0]], 1)  # [B, C, H]

    def _packed(
        self,
        decoder,
        head,
        completion_ids,
        completion_mask,
        with_entropy,
        entropy_grad,
        input_ids,
        position_ids,
        piece_ids,
        member_ids,
        score_index,
    ):
        """The packed rows [R, L] through the model once; only the N states that predict a completion token go
        through the LM head, and the results are laid out as [B, C] again for the loss."""
        plan = SegmentPlan.of(piece_ids.cpu(), member_ids.cpu()) if runs_segments(decoder) else None
        if plan is not None and plan.pays:  # SDPA, long rows: attention segment by segment
            mask = placeholder_mask(input_ids.shape[0], input_ids.device)
            extra = {LAYOUT_KEY: plan.layout().to(input_ids.device)}
        else:  # eager, or short rows: one dense mask over each row
            mask = packed_attention_mask(
                piece_ids, member_ids, decoder.config._attn_implementation, self._dtype(decoder)
            )
            extra = {}
        hidden = decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False, **extra
        ).last_hidden_state
        scored = completion_mask > 0  # [B, C]
        states = hidden.flatten(0, 1)[score_index[scored]]  # [N, H]
        logp, entropy = self._score(head, states[None], completion_ids[scored][None], with_entropy, entropy_grad)
        return _unflatten(logp[0], scored), (None if entropy is None else _unflatten(entropy[0], scored))

    @staticmethod
    def _dtype(decoder) -> torch.dtype:
        return next(decoder.parameters()).dtype

    def _score(self, head, hidden, targets, with_entropy, entropy_grad=False):
        """log p(target) (and entropy) from hidden states [B, C, H], a chunk of positions at a time.

        Each chunk's full-vocabulary logits exist only while that chunk is scored. In a pass that records
        gradients and needs more than one chunk, each chunk runs under activation checkpointing: autograd keeps
        its hidden states, and the backward pass computes its logits again (one more output-head matmul),
        instead of keeping every chunk's [B, c, V] log-softmax until the backward. Recomputed, the same numbers
        (the same operations on the same inputs), so the gradients are unchanged. A single chunk is not
        recomputed: that would cost a head matmul and save nothing (measurements: docs/performance.md).
        Where the ranks must call every module equally often (`agree_chunks`: ZeRO-3, FSDP), every rank makes
        as many chunks as the rank that needs the most, the ones past its own positions empty, and recomputes
        when that count is above one (the same choice on every rank, so the head's calls pair up in the backward
        too).
        """
        positions = self._positions_per_chunk(hidden.shape[0])
        chunks = max(1, -(-targets.shape[1] // positions))
        calls = chunks if self.agree_chunks is None else self.agree_chunks(chunks)
        recompute = torch.is_grad_enabled() and hidden.requires_grad and calls > 1  # the same choice on every rank
        logps, entropies = [], []
        for k in range(calls):
            # Past this rank's own chunks (calls agreed across ranks), an empty chunk: the head is still called,
            # forward and backward, so its weight gathers pair up with the other ranks'.
            start = min(k * positions, targets.shape[1])
            chunk = (
                head,
                hidden[:, start : start + positions],
                targets[:, start : start + positions],
                with_entropy,
                entropy_grad,
            )
            if recompute:
                logp, entropy = checkpoint(self._score_chunk, *chunk, use_reentrant=False)
            else:
                logp, entropy = self._score_chunk(*chunk)
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps, 1), (torch.cat(entropies, 1) if with_entropy else None)

    def _score_chunk(self, head, hidden, targets, with_entropy, entropy_grad):
        logits = self._logits(head, hidden).float()  # [B, c, V]
        if with_entropy and entropy_grad and torch.is_grad_enabled():  # the entropy term: autograd through both
            logp_all = (logits / self.temperature).log_softmax(-1)
            return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
        return lm_head.target_logprobs(logits, targets, self.temperature, with_entropy)

    def _logits(self, head, hidden):
        """`head(hidden)`; for a head tied to the input embeddings, by lm_head.tied_head_logits (the same numbers,
        less memory) where nothing else wraps the head's calls (no sharded weights, no autocast casting its
        operands: autograd's path then holds the casts' gradients as well)."""
        tied = (
            self.agree_chunks is None
            and torch.is_grad_enabled()
            and head.weight.device == hidden.device
            and not torch.is_autocast_enabled(hidden.device.type)
            and head.weight is base_model(self.lm).get_input_embeddings().weight
        )
        return lm_head.tied_head_logits(head, hidden) if tied else head(hidden)

    def _positions_per_chunk(self, rows: int) -> int:
        """`chunk_size` if given (`model.logprob_chunk_size`), else as many positions as keep a chunk's float32
        logits within LOGITS_CHUNK_BYTES (the tiny model's never split: 128 tokens of vocabulary)."""
        if self.chunk_size is not None:
            return self.chunk_size
        vocab = getattr(getattr(self.lm, "config", None), "vocab_size", None) or 2**17
        return max(1, LOGITS_CHUNK_BYTES // (4 * vocab * max(1, rows)))


def _unflatten(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """values [N] back to the [B, C] positions `where` marks (differentiable); 0 elsewhere."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


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


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass
class PackedBatch:
    """Completions laid out with their prompts shared and nothing padded but row slack (`train.packing`).

    A *piece* is a prompt followed by some of its completions (a whole group, or part of one): the prompt's
    tokens, then each completion's tokens but the last (whose state predicts nothing scored) back to back.
    Pieces are packed into rows [R, L]; each completion sees its prompt and its own earlier tokens only
    (`packed_attention_mask`), its positions continuing from the end of the prompt: the numbers of running
    prompt + completion alone. The outputs come back as [B, C] (`score_index`), the layout the loss reads.
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    piece_ids: torch.Tensor  # [R, L] the piece a token belongs to (unique within its row); -1 on row slack
    member_ids: torch.Tensor  # [R, L] 0 on prompt tokens (and slack), i + 1 on the piece's i-th completion
    score_index: torch.Tensor  # [B, C] index into the flattened [R * L] states of the one predicting token t of b
    completion_ids: torch.Tensor  # [B, C] right-padded: the targets
    completion_mask: torch.Tensor  # [B, C] 1.0 for real completion tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.shape[1]

    def tensors(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The keyword arguments of `TokenLogprobs.forward`, on `device`."""
        return {name: getattr(self, name).to(device) for name in self.__dataclass_fields__}


def piece_tokens(prompt_length: int, completion_lengths: list[int]) -> int:
    """Tokens a piece puts through the model when packed: the prompt once, each completion less its last token."""
    return prompt_length + sum(max(c - 1, 0) for c in completion_lengths)


def pack_rows(sizes: list[int]) -> list[list[int]]:
    """Pieces (by size) into rows: first-fit decreasing into rows as long as the longest piece.

    Attention in a row costs its length squared whatever the mask hides (the CPU's SDPA computes the masked
    blocks too; docs/performance.md), so a row is no longer than the longest piece; short pieces share one,
    and rows differ in length only by the slack first-fit leaves."""
    capacity = max(sizes, default=0)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        row = next((r for r, free in enumerate(room) if free >= sizes[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= sizes[i]
    return rows


def packed_tokens(sizes: list[int]) -> int:
    """Tokens `make_packed_batch` will compute for pieces of these sizes: rows x the longest row."""
    rows = pack_rows(sizes)
    return len(rows) * max((sum(sizes[i] for i in row) for row in rows), default=0)


def make_packed_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> PackedBatch:
    """Row b of the outputs is completions[b], continuing prompts[b]; completions of the same prompt form one piece."""
    pieces: dict[tuple[int, ...], list[int]] = {}
    for b, prompt_ids in enumerate(prompts):
        pieces.setdefault(tuple(prompt_ids), []).append(b)
    keys = list(pieces)
    if not all(keys):
        raise ValueError("an empty prompt cannot be packed: no state would predict its completions' first tokens")
    sizes = [piece_tokens(len(p), [len(completions[b]) for b in pieces[p]]) for p in keys]
    rows = pack_rows(sizes)
    width = max(sum(sizes[i] for i in row) for row in rows)
    shape = (len(rows), width)
    ids, positions = torch.full(shape, pad_id, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    piece_ids, member_ids = torch.full(shape, -1, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    c_len = max(max((len(c) for c in completions), default=1), 1)
    score_index = torch.zeros(len(completions), c_len, dtype=torch.long)
    ends = [0] * len(rows)  # the next free position of each row

    def put(r: int, tokens: list[int], first_position: int, piece: int, member: int) -> int:
        """Write a span at the end of row r; returns the flat index (into R * L) of its first token."""
        start, n = ends[r], len(tokens)
        ids[r, start : start + n] = torch.tensor(tokens, dtype=torch.long)
        positions[r, start : start + n] = torch.arange(first_position, first_position + n)
        piece_ids[r, start : start + n], member_ids[r, start : start + n] = piece, member
        ends[r] += n
        return r * width + start

    for r, row in enumerate(rows):
        for k, i in enumerate(row):
            prompt = keys[i]
            last_prompt_state = put(r, list(prompt), 0, k, 0) + len(prompt) - 1
            for j, b in enumerate(pieces[prompt]):
                n = len(completions[b])
                first = put(r, completions[b][:-1], len(prompt), k, j + 1)  # its last token predicts nothing scored
                # token 0 is predicted by the prompt's last state, token t > 0 by the state of token t - 1
                score_index[b, :n] = torch.tensor([last_prompt_state] + list(range(first, first + n - 1)))[:n]
    return PackedBatch(
        input_ids=ids,
        position_ids=positions,
        piece_ids=piece_ids,
        member_ids=member_ids,
        score_index=score_index,
        completion_ids=torch.tensor([c + [pad_id] * (c_len - len(c)) for c in completions], dtype=torch.long),
        completion_mask=torch.tensor([[1.0] * len(c) + [0.0] * (c_len - len(c)) for c in completions]),
    )


def packed_attention_mask(
    piece_ids: torch.Tensor, member_ids: torch.Tensor, implementation: str, dtype: torch.dtype
) -> torch.Tensor:
    """The [R, 1, L, L] mask of packed rows: token q sees token k <= q of its own piece when k is a prompt token or
    a token of q's own completion. Slack sees earlier slack (never a real token), so no row of the softmax is empty.

    A 4D mask goes to the model's attention as it is (transformers' `create_causal_mask` returns it unchanged):
    boolean for SDPA (True: attend), additive for the eager path."""
    positions = torch.arange(piece_ids.shape[1], device=piece_ids.device)
    causal = positions[:, None] >= positions[None, :]  # [L, L]
    same_piece = piece_ids[:, :, None] == piece_ids[:, None, :]  # [R, L, L]
    key_member = member_ids[:, None, :]
    visible = (key_member == 0) | (key_member == member_ids[:, :, None])
    allowed = (causal & same_piece & visible)[:, None]  # [R, 1, L, L]
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(
        f"packed rows need an attention path that takes a 4D mask ({', '.join(PACKED_ATTENTION)}), "
        f"not {implementation!r} (models.check_packing_support)"
    )


PACKED_ATTENTION = ("sdpa", "eager")


def check_packing_support(lm) -> None:
    """`train.packing` needs an attention path that takes an explicit 4D mask, and full attention in every layer:
    say so before training rather than inside the first update."""
    base = base_model(lm)
    config = base.config
    implementation = config._attn_implementation
    if implementation not in PACKED_ATTENTION:
        raise ConfigError(
            f"train.packing: {type(base).__name__} runs attention with {implementation!r}, which takes no custom mask; "
            f"packing needs one of {', '.join(PACKED_ATTENTION)}; set train.packing=false"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    if sliding or (
        not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    ):
        raise ConfigError(
            f"train.packing: {type(base).__name__} has sliding-window attention layers ({sliding[:1] or 'sliding_window'}); "
            "packing builds one full-attention mask; set train.packing=false"
        )


def check_same_vocabulary(policy_tokenizer, other_tokenizer, what: str) -> None:
    """Refuse a second model (a teacher) whose tokenizer maps tokens to ids differently from the policy's: its
    log-prob of a sampled id would be of another token. Vocabularies are compared, not configs: models of one
    family can share a tokenizer while their `vocab_size` (padded embedding rows) differs."""
    mine, theirs = policy_tokenizer.get_vocab(), other_tokenizer.get_vocab()
    if mine == theirs:
        return
    differ = sorted(token for token in mine.keys() | theirs.keys() if mine.get(token) != theirs.get(token))
    shown = ", ".join(f"{t!r}: {mine.get(t)} vs {theirs.get(t)}" for t in differ[:3])
    raise ConfigError(
        f"{what}: its tokenizer's vocabulary differs from the policy's ({len(mine)} vs {len(theirs)} "
        f"tokens; {len(differ)} differ, e.g. {shown}): a teacher must share the policy's tokenizer"
    )
