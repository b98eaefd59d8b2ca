"""The Python entry point: `grpo_trainer.train(config, overrides, train_dataset=..., rewards=[...], model=...)`.

For a notebook or a script that already holds a dataset, reward functions, a model: the same run as the
command line's, with objects where the YAML has paths. The YAML stays the reference: every object becomes a
reference in the config (`object:...`, see in_memory.py), then the config is validated and trained exactly
as `python -m grpo_trainer train` trains it, so an object and its YAML equivalent give the same run, number
for number (tests/test_api.py). Under `accelerate launch script.py` every rank calls this with its own copy
of the objects, as every rank of the command line reads its own copy of the files.

    import grpo_trainer
    result = grpo_trainer.train("configs/demo_cpu.yaml", ["train.max_steps=20"],
                                train_dataset=my_dataset, rewards=[my_reward, {"fn": other, "weight": 0.5}])
    result.output_dir, result.last_metrics

docs/python_api.md is the guide.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from . import in_memory
from .checkpoint import find_resume_checkpoint, flatten, read_trainer_state
from .config import Config, RewardConfig, apply_override, config_from_dict, read_config_file, set_dotted
from .data import with_every_column
from .errors import ConfigError
from .rollout.engines import engine_kind

logger = logging.getLogger("grpo_trainer")

TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def train(
    config: str | Path | Mapping[str, Any] | Config | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    rewards: list[Any] | None = None,
    model: Any = None,
    tokenizer: Any = None,
    on_step_end: Callable[[int], None] | None = None,
):
    """Train, and return a `TrainResult` (`output_dir`, `last_metrics`, `steps_done`, ...).

    config:         a YAML file, a dict of the same shape, a `Config`, or None (the defaults).
    overrides:      dotted overrides, as strings (`["train.max_steps=50"]`, parsed as YAML like on the command
                    line) or a dict (`{"train.max_steps": 50}`, values used as they are).
    train_dataset:  a `datasets.Dataset` or a list of dicts (columns); replaces `data.source`.
    eval_dataset:   the same, for `eval.every`; replaces `data.eval_source`.
    rewards:        replaces the config's rewards. Each item is a function (TRL's signature, sync or async), a
                    dict `{"fn": function, "weight": 0.5, "kwargs": {...}, "alias": ..., "timeout": ...}` (the
                    keys of a YAML reward entry, with `fn` for `name`), or a YAML reward entry (`"math_accuracy"`,
                    `{"name": "file.py:fn"}`). Metrics name a function by its `__name__` (or `alias`).
    model:          a causal LM already loaded (trained in place, as TRL does); replaces `model.name_or_path`,
                    and its dtype sets `model.dtype`. Sampling with `rollout.engine: hf`. A string (a Hub id,
                    a folder, `builtin:tiny`) is `model.name_or_path` itself, as TRL reads a string model.
    tokenizer:      its tokenizer (copied: the caller's is left as it is), or a Hub id or folder. Without it, a
                    given model's tokenizer is loaded from where the model was loaded from.

    Resuming (`checkpoint.resume: auto`, the default) a run that was given objects needs the same objects
    again: a missing one is refused naming it, a dataset whose records changed is refused like any other
    change of what the run means.
    """
    from .trainer import train as train_config

    data = config_data(config)
    _apply_overrides(data, overrides)
    objects: dict[str, Any] = {}
    if train_dataset is not None:
        set_dotted(data, "data.source", _dataset(train_dataset, "train_dataset", objects))
    if eval_dataset is not None:
        set_dotted(data, "data.eval_source", _dataset(eval_dataset, "eval_dataset", objects))
    if rewards is not None:
        data["rewards"] = [_reward_entry(item, i, objects) for i, item in enumerate(_as_list(rewards, "rewards"))]
    if isinstance(model, (str, Path)):  # a Hub id or folder, as TRL takes it: the config's model.name_or_path
        set_dotted(data, "model.name_or_path", str(model))
        model = None
    elif model is not None:
        _check_causal_lm(model)
        objects["model"] = model  # wrapped below, once the config says whether a reference copy is needed
        set_dotted(data, "model.name_or_path", in_memory.reference("model"))
        _set_dtype(data, _dtype_name(model))
    if isinstance(tokenizer, (str, Path)):  # a Hub id or folder: the config's model.tokenizer
        set_dotted(data, "model.tokenizer", str(tokenizer))
    elif tokenizer is not None:
        objects["tokenizer"] = tokenizer
        set_dotted(data, "model.tokenizer", in_memory.reference("tokenizer"))
    elif model is not None and not (data.get("model") or {}).get("tokenizer"):
        set_dotted(data, "model.tokenizer", _where_loaded_from(model))
    cfg = config_from_dict(data, source=_describe(config))
    _check_objects_fit(cfg, objects)
    _refuse_resume_without_objects(cfg, objects)
    if model is not None:
        # The frozen reference of the KL term (run._reference: beta > 0, and not LoRA, whose reference is the
        # adapter-disabled policy) is a copy taken now, before any step, as the YAML path loads one from disk.
        objects["model"] = in_memory.ModelObject(model, copy.deepcopy(model) if cfg.needs_reference else None)
    with in_memory.given(objects):
        return train_config(cfg, on_step_end=on_step_end)


def config_data(config: str | Path | Mapping[str, Any] | Config | None) -> dict[str, Any]:
    """The config as a plain dict (a copy: the caller's dict or Config is never changed)."""
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.dump_unresolved()
    if isinstance(config, (str, Path)):
        return read_config_file(config)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigError(f"config: expected a YAML path, a dict or a grpo_trainer.Config, got {type(config).__name__}")


def _apply_overrides(data: dict[str, Any], overrides: Iterable[str] | Mapping[str, Any]) -> None:
    """Strings as on the command line, or a dict of dotted keys (a mapping value merges into its section, as
    `train={...}` does on the command line: `{"train": {"max_steps": 1}}` keeps the section's other keys)."""
    expected = "expected a list of KEY=VALUE strings or a dict"
    if isinstance(overrides, str):
        raise ConfigError(f"overrides: {expected}, got the string {overrides!r}")
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            if not isinstance(key, str) or not key.strip():
                raise ConfigError(f"overrides: its keys are dotted config keys (e.g. 'train.max_steps'), got {key!r}")
            set_dotted(data, key, value)
        return
    if not isinstance(overrides, Iterable):
        raise ConfigError(f"overrides: {expected}, got {type(overrides).__name__}")
    for i, override in enumerate(overrides):
        if not isinstance(override, str):
            raise ConfigError(
                f"overrides[{i}]: expected a KEY=VALUE string (e.g. 'train.max_steps=50'), got "
                f"{type(override).__name__} {override!r:.60}"
            )
        apply_override(data, override)


def _describe(config: Any) -> str:
    return str(config) if isinstance(config, (str, Path)) else f"<{type(config).__name__} given to grpo_trainer.train>"


def _as_list(value: Any, where: str) -> list[Any]:
    if callable(value) or isinstance(value, (str, Mapping)):
        return [value]  # one reward on its own
    try:
        return list(value)
    except TypeError:
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}") from None


# ----------------------------------------------------------------------------- datasets


def _dataset(dataset: Any, argument: str, objects: dict[str, Any]) -> str:
    """Register the dataset's records under `argument`; its reference, with the fingerprint of its records."""
    rows = dataset_records(dataset, argument)
    records = in_memory.Records(rows, in_memory.fingerprint(rows))
    objects[argument] = records
    return in_memory.reference(argument, records.fingerprint)


def dataset_records(dataset: Any, argument: str) -> list[dict[str, Any]]:
    """A `datasets.Dataset` or a list of dicts as the trainer reads records: every record with every column."""
    kind = type(dataset).__name__
    if kind in ("DatasetDict", "IterableDatasetDict"):
        raise ConfigError(f"{argument}: a {kind} holds several splits; pass one, e.g. {argument}=dataset['train']")
    if kind == "IterableDataset":
        raise ConfigError(
            f"{argument}: an IterableDataset has no length to shuffle over; pass a Dataset (or a list of dicts)"
        )
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, Mapping)), None)
        if bad is not None:
            raise ConfigError(f"{argument}: record {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
        rows = [dict(row) for row in rows]
    else:
        raise ConfigError(f"{argument}: expected a datasets.Dataset or a list of dicts, got {kind}")
    if not rows:
        raise ConfigError(f"{argument}: the dataset has no records")
    return with_every_column(rows)


# ----------------------------------------------------------------------------- rewards


def _reward_entry(item: Any, i: int, objects: dict[str, Any]) -> dict[str, Any]:
    """One item of `rewards=` as a YAML reward entry; a function is registered and named by reference."""
    where = f"rewards[{i}]"
    if isinstance(item, RewardConfig):
        return item.model_dump(mode="json")
    if isinstance(item, str):
        return {"name": item}
    if callable(item):
        item = {"fn": item}
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where}: expected a function, a dict or a reward name, got {type(item).__name__}")
    entry = dict(item)
    fn = entry.pop("fn", None)
    if fn is None:
        return entry  # a YAML entry (name, or model) as it is
    if "name" in entry:
        raise ConfigError(f"{where}: give `fn` (a function) or `name` (a YAML reward name), not both")
    if not callable(fn):
        raise ConfigError(f"{where}.fn: expected a function, got {type(fn).__name__}")
    name = entry.get("alias") or _function_name(fn)
    if name is None:
        raise ConfigError(
            f"{where}: this function has no name to log its metrics under ({fn!r}); "
            "give it one: {'fn': ..., 'alias': 'my_reward'}"
        )
    key = in_memory.REWARD_PREFIX + name
    if key in objects:
        raise ConfigError(
            f"{where}: two reward functions are named {name!r}; give one an alias: {{'fn': ..., 'alias': ...}}"
        )
    objects[key] = fn
    entry["name"] = in_memory.reference(key)
    if getattr(fn, "__name__", None) != name:
        entry["alias"] = name  # metrics use the name the reference carries (a partial, a callable object)
    return entry


def _function_name(fn: Any) -> str | None:
    """The name metrics give a reward function: its __name__ (a partial's function's), never `<lambda>`."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__name__", None)
    if name is None and not inspect.isfunction(target) and not inspect.ismethod(target):
        name = type(target).__name__  # a callable object: its class
    return None if name in (None, "<lambda>") else name


# ----------------------------------------------------------------------------- models


def _check_causal_lm(model: Any) -> None:
    """A model object must be a causal LM: a torch module with a transformers config and `generate` (what
    AutoModelForCausalLM gives, PEFT's wrappers included); anything else is refused before anything loads."""
    import torch

    lacks = [
        what
        for what, ok in (
            ("is not a torch.nn.Module", isinstance(model, torch.nn.Module)),
            ("has no `config`", hasattr(model, "config")),
            ("has no `generate`", callable(getattr(model, "generate", None))),
        )
        if not ok
    ]
    if lacks:
        raise ConfigError(
            f"model: expected a causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)) or its Hub id "
            f"or folder as a string; the {type(model).__name__} given {' and '.join(lacks)}"
        )


def _dtype_name(model: Any) -> str:
    dtype = str(getattr(model, "dtype", "torch.float32"))
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"model: its dtype is {dtype}; the trainer runs float32, bfloat16 or float16 models")
    return TORCH_DTYPES[dtype]


def _set_dtype(data: dict[str, Any], dtype: str) -> None:
    """The model object's dtype is the run's: say so when the config asked for another."""
    asked = (data.get("model") or {}).get("dtype")
    if asked not in (None, dtype):
        logger.warning("model.dtype: the model given is %s; the config's %s does not apply to it", dtype, asked)
    set_dotted(data, "model.dtype", dtype)


def _where_loaded_from(model: Any) -> str:
    source = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not source:
        raise ConfigError(
            "model= was given without tokenizer=, and the model does not say where it was loaded from "
            "(no name_or_path): pass tokenizer= as well"
        )
    return str(source)


# ----------------------------------------------------------------------------- checks


def _check_objects_fit(cfg: Config, objects: dict[str, Any]) -> None:
    """What cannot work with objects stops here, before anything loads."""
    if "model" in objects and not engine_kind(cfg.rollout.engine).samples_from_training_model:
        raise ConfigError(
            f"rollout.engine: {cfg.rollout.engine} loads the model from model.name_or_path; a model "
            "given as an object samples with rollout.engine=hf (or pass its folder in the config)"
        )
    if cfg.eval.every and in_memory.is_reference(cfg.data.source) and cfg.data.eval_source is None:
        raise ConfigError(
            "eval.every: the training data was given as an object, which has no held-out split; "
            "pass eval_dataset= (or set data.eval_source)"
        )


def _refuse_resume_without_objects(cfg: Config, objects: dict[str, Any]) -> None:
    """Resuming a run that was given objects needs them again: one line naming the first one missing.

    (A dataset given again with other records is refused later by the resume check, as a change of data.source.)
    """
    found, _ = find_resume_checkpoint(cfg.output_dir, cfg.checkpoint.resume)
    if found is None or cfg.checkpoint.force_resume:
        return
    saved = flatten(read_trainer_state(found).get("config", {}))
    for key, value in saved.items():
        if in_memory.is_reference(value):
            name = in_memory.parse(value)[0]
            if name not in objects:
                raise ConfigError(
                    f"cannot resume from {found}: its run was given {name} in Python ({key}: {value}); pass "
                    f"{in_memory.what_to_pass(name)} again (or start over with checkpoint.resume=never)"
                )
