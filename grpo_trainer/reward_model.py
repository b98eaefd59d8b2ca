"""Learned reward models: a sequence-classification model scores prompt + completion.

A reward entry with `model: PATH` (config: `rewards.N.model`) loads
`AutoModelForSequenceClassification` and its tokenizer from PATH and becomes a
reward like any other: a callable with TRL's signature, weighted and summed with
the verifiable rewards, its scores logged as `rewards/<name>/mean` and `.../std`.

How a completion is scored:
- Text: the dataset prompt (a string becomes one user message; a message list is
  used as it is) and the completion as the assistant's message, through the
  reward model's own chat template (or `model.chat_template`). A tokenizer with no
  template gets the plain text `prompt + completion`, as TRL scores
  non-conversational data (a message list's contents joined by newlines); that is
  logged as a warning at load time. `data.system_prompt` is the policy's
  formatting and is not shown to the reward model.
- Tokens: the text's tokens (special tokens added only when no template wrote
  them), at most `max_length`: a longer text loses its start, since the score is
  read at the last token (counted in `rewards/<name>/truncated`).
- Score: the model's single logit at the last non-pad token, as its own forward
  pools it, in float32. Texts are sorted by length and run `batch_size` at a time,
  right-padded, so a score does not depend on the batch it was run in (up to float
  rounding).

Each rank scores its own completions (the trainer calls rewards per rank) with
its own whole copy of the model, on the trainer's device (Accelerate's), in the
policy's dtype unless `model.dtype` says otherwise, in eval mode without
gradients. A model is loaded once per process: the training and evaluation tasks
share it.

Deliberately not done: sharding the reward model (ZeRO-3/FSDP shard the policy
only; the reward model must fit on each device), pairwise or multi-output heads
(num_labels must be 1), reward normalisation (advantages are group-normalised
anyway), `trust_remote_code` models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import RewardModelConfig
from .distributed import whole_parameters_on_load
from .errors import RewardError

logger = logging.getLogger("grpo_trainer")

Conversation = list[dict[str, Any]]


class RewardModel:
    """A loaded reward model as a reward function: `rm(prompts, completions) -> list[float | None]`."""

    def __init__(self, model, tokenizer, batch_size: int, max_length: int | None, chat_template: str | None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.chat_template = chat_template  # None: plain text
        self.pad_token_id = model.config.get_text_config().pad_token_id

    def __call__(
        self, prompts: list[Any], completions: list[Any], log_metric: Callable[[str, float], None] | None = None
    ):
        ids = self.token_ids(prompts, completions)
        truncated = sum(len(row) > self.max_length for row in ids) if self.max_length else 0
        if self.max_length:
            ids = [row[-self.max_length :] for row in ids]
        if log_metric is not None:
            log_metric("truncated", truncated)
        return self.score_token_ids(ids)

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """The text the reward model reads for each (prompt, completion)."""
        if self.chat_template is None:
            return [_plain(p) + _plain(c) for p, c in zip(prompts, completions)]
        return [
            self.tokenizer.apply_chat_template(_conversation(p, c), chat_template=self.chat_template, tokenize=False)
            for p, c in zip(prompts, completions)
        ]

    def token_ids(self, prompts: list[Any], completions: list[Any]) -> list[list[int]]:
        """Token ids of `texts`, untruncated. A chat template writes its own special tokens (BOS included)."""
        encoded = self.tokenizer(self.texts(prompts, completions), add_special_tokens=self.chat_template is None)
        return [list(row) for row in encoded["input_ids"]]

    @torch.inference_mode()
    def score_token_ids(self, ids: list[list[int]]) -> list[float | None]:
        """One score per token list (None for an empty one), `batch_size` lists per forward, shortest first."""
        scores: list[float | None] = [None] * len(ids)
        order = sorted((i for i in range(len(ids)) if ids[i]), key=lambda i: len(ids[i]))
        device = next(self.model.parameters()).device
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)  # [b, T], right-padded
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):
                input_ids[j, : len(ids[i])] = torch.tensor(ids[i])
                attention_mask[j, : len(ids[i])] = 1
            logits = self.model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
            ).logits
            for i, value in zip(rows, logits[:, 0].float().tolist()):  # logits: [b, 1]
                scores[i] = value
        return scores


def _conversation(prompt: Any, completion: Any) -> Conversation:
    prompt_messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    completion_messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    return [*prompt_messages, *completion_messages]


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(str(m.get("content", "")) for m in value)


# ----------------------------------------------------------------------------- loading

_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}  # (path, dtype, device) -> (model, tokenizer)


def load_reward_model(
    cfg: RewardModelConfig, where: str, policy_dtype: str, device: torch.device | str | None = None
) -> RewardModel:
    """The reward model of `cfg` (config path `where`, e.g. `rewards.1.model`) as a reward function.

    dtype `auto` is the policy's `policy_dtype`; `device` None is the trainer's (Accelerate's process device).
    Raises RewardError naming `where` and the path when the model cannot serve as a reward model.
    """
    from .models import DTYPES, context_length

    if device is None:
        from .distributed import partial_state

        device = partial_state().device
    dtype = policy_dtype if cfg.dtype == "auto" else cfg.dtype
    local = Path(cfg.path).expanduser()
    source = (
        str(local.resolve()) if local.exists() else cfg.path
    )  # a folder (relative to the launch directory), or a hub id
    key = (source, dtype, str(torch.device(device)))
    if key not in _LOADED:
        _LOADED[key] = _load(source, where, DTYPES[dtype], device)
        model = _LOADED[key][0]
        logger.info(
            "%s: reward model %s (%s, %s parameters, %s on %s)",
            where,
            cfg.path,
            type(model).__name__,
            f"{sum(p.numel() for p in model.parameters()):,}",
            dtype,
            device,
        )
    model, tokenizer = _LOADED[key]
    template = cfg.chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        logger.warning(
            "%s: the reward model's tokenizer (%s) has no chat template: prompt + completion are scored as "
            "plain text; set %s.chat_template if the model was trained on a chat format",
            where,
            cfg.path,
            where,
        )
    max_length = cfg.max_length or context_length(model)
    return RewardModel(model, tokenizer, cfg.batch_size, max_length, template)


def _load(path: str, where: str, dtype: torch.dtype, device) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    def failed(what: str, exc: Exception) -> RewardError:
        return RewardError(
            f"{where}.path: cannot load the reward model's {what} from {path!r}: {type(exc).__name__}: {exc}"
        )

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise failed("config", exc) from None
    if config.num_labels != 1:
        raise RewardError(
            f"{where}.path: {path!r} has num_labels={config.num_labels}; a reward model gives one score per text "
            "(a sequence-classification model with num_labels=1)"
        )
    try:
        with whole_parameters_on_load():  # never prepared by Accelerate: each rank needs all of its weights
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, output_loading_info=True
            )
    except Exception as exc:
        raise failed("weights", exc) from None
    if info.get("missing_keys"):  # e.g. a causal LM: its score head would be random
        missing = sorted(info["missing_keys"])
        raise RewardError(
            f"{where}.path: {path!r} is not a trained sequence-classification model: {len(missing)} weights are "
            f"missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) and would be random"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise failed("tokenizer", exc) from None
    text_config = model.config.get_text_config()
    if text_config.pad_token_id is None:
        # Padding needs an id the model pools past; without one, batches > 1 cannot be scored.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise RewardError(
                f"{where}.path: {path!r}: neither the reward model nor its tokenizer has a pad or EOS token"
            )
        text_config.pad_token_id = pad
    return model.to(device).eval().requires_grad_(False), tokenizer
