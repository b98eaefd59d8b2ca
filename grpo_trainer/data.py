"""Prompts: load records, format them with the chat template, and hand them out in a resumable order.

A record is a dict of dataset columns. The prompt column becomes the model's
input; every column (the prompt's too) reaches the rewards as a keyword list, and the answer column is
also passed as `answer`, the name the built-in rewards read.

The sampler is a pure function of (seed, epoch, position): resuming needs only
those two counters, and every rank computes the same global order, then takes
its own contiguous slice.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import builtin, in_memory
from .config import DataConfig
from .errors import DataError
from .seeds import mix_seed

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_records(cfg: DataConfig, split: str | None = None) -> list[dict[str, Any]]:
    """Read the configured source into a list of column dicts."""
    split = split or cfg.split
    source = cfg.source
    if in_memory.is_reference(source):  # a dataset given to grpo_trainer.train() in Python: one split, as given
        records = in_memory.records(source, "data.source", DataError)
    elif builtin.is_builtin(source):
        records = builtin.task_records(source, split)
    else:
        records = _load_with_datasets(source, cfg.subset, split)
    if cfg.num_samples is not None:
        records = records[: cfg.num_samples]
    if not records:
        raise DataError(f"data.source {source!r} (split {split!r}) has no records")
    return records


def _load_with_datasets(source: str, subset: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    path = Path(source)
    suffix = path.suffix.lower()
    try:
        if suffix in LOCAL_FORMATS:
            if not path.is_file():
                raise DataError(f"data.source: file not found: {source}")
            if LOCAL_FORMATS[suffix] == "json":
                return read_json_records(path)
            # A local file is one split; its name in `datasets` is always "train".
            ds = datasets.load_dataset(LOCAL_FORMATS[suffix], data_files=str(path), split="train")
        elif path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(source, subset, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the source and the reason
        raise DataError(
            f"data.source: could not load {source!r} (split {split!r}): {type(exc).__name__}: {exc}"
        ) from None
    return ds.to_list()


def read_json_records(path: Path) -> list[dict[str, Any]]:
    """A .jsonl file (one object per line) or a .json file (an array of objects, or JSON lines).

    Read here rather than by `datasets`, so that a malformed record is reported with its file and line
    number. Every record gets every column, as `datasets` would give them: a column a record lacks is None.
    """
    text = path.read_text()
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"data.source: {path}, line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
            ) from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"data.source: {path}, line {number}: not valid JSON ({exc.msg}, column {exc.colno}): {line.strip()[:80]!r}"
                ) from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"data.source: {path}: record {i} is a JSON {type(row).__name__}, not an object of columns")
    return with_every_column(rows)


def with_every_column(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every record gets every column, as `datasets` gives them: a column a record lacks is None."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in columns} for row in rows]


@dataclass
class PromptSet:
    """Formatted, tokenized prompts and the columns that travel with them to the rewards."""

    records: list[dict[str, Any]]
    texts: list[str]  # what the model sees, chat template applied
    token_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.records)

    def reward_columns(self, indices: list[int], answer_column: str) -> dict[str, list[Any]]:
        """Columns of the selected records as keyword lists (TRL's reward convention)."""
        columns: dict[str, list[Any]] = {}
        for key in self.records[indices[0]]:
            columns[key] = [self.records[i].get(key) for i in indices]
        if answer_column in columns and "answer" not in columns:
            columns["answer"] = columns[answer_column]
        return columns


def build_prompt_set(
    cfg: DataConfig,
    tokenizer,
    records: list[dict[str, Any]],
    context_length: int | None,
    tools: list[dict[str, Any]] | None = None,
) -> PromptSet:
    """Check the columns, format every prompt and tokenize it; fail before training on any bad record.
    `tools` (JSON schemas, environment.tools) reach the chat template as its `tools=` argument."""
    missing = [c for c in (cfg.prompt_column,) if c not in records[0]]
    if missing:
        raise DataError(
            f"data.prompt_column: column {missing[0]!r} is not in the dataset {cfg.source!r}; "
            f"its columns are: {', '.join(records[0])}"
        )
    if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.use_chat_template is true but the tokenizer has no chat template: "
            "set data.chat_template to a Jinja template, or data.use_chat_template=false for plain-text prompts"
        )
    if tools and not cfg.use_chat_template:
        raise DataError(
            "environment.tools needs data.use_chat_template=true: tools are described through the chat template"
        )
    texts = [format_prompt(cfg, tokenizer, r[cfg.prompt_column], i, tools) for i, r in enumerate(records)]
    token_ids = [tokenizer(t, add_special_tokens=not cfg.use_chat_template)["input_ids"] for t in texts]
    limit = cfg.max_prompt_length or context_length
    if limit:
        for i, ids in enumerate(token_ids):
            if len(ids) > limit:
                key = "data.max_prompt_length" if cfg.max_prompt_length else "the model's context length"
                raise DataError(
                    f"record {i}: the prompt has {len(ids)} tokens, more than {key} ({limit}): {texts[i][:200]!r}"
                )
    return PromptSet(records=records, texts=texts, token_ids=token_ids)


def format_prompt(
    cfg: DataConfig, tokenizer, prompt: Any, index: int, tools: list[dict[str, Any]] | None = None
) -> str:
    """One prompt (a string or a list of chat messages) as the text the model is given."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        messages = list(prompt)
    else:
        raise DataError(
            f"record {index}: column {cfg.prompt_column!r} must be a string or a list of "
            f"{{role, content}} messages, got {type(prompt).__name__}: {str(prompt)[:200]!r}"
        )
    if not cfg.use_chat_template:
        if len(messages) != 1:
            raise DataError(f"record {index}: chat-message prompts need data.use_chat_template=true")
        return (cfg.system_prompt + "\n" if cfg.system_prompt else "") + messages[0]["content"]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, tools=tools or None, **cfg.chat_template_kwargs
    )


def is_conversational(records: list[dict[str, Any]], prompt_column: str) -> bool:
    """TRL's rule: message-list prompts make completions message lists too."""
    return isinstance(records[0].get(prompt_column), list)


@dataclass
class PromptSampler:
    """Endless, epoch-shuffled order over `size` prompts; its whole state is (epoch, position)."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(mix_seed(self.seed, epoch)).shuffle(order)
        return order

    def next_indices(self, count: int) -> list[int]:
        """The next `count` prompt indices (the same on every rank), advancing the state."""
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
