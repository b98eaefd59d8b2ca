"""Objects given to `grpo_trainer.train()` in Python, and the references that name them in the config.

The config stays the one description of a run: a dataset, a reward function, a model or a tokenizer given as
an object is named in it by a reference, so the resolved `config.yaml`, the checkpoint's config and the resume
check all say what the run was given:

    data.source:        object:train_dataset@3f9a0c1d2e4b5a69     (datasets carry the fingerprint of their records)
    data.eval_source:   object:eval_dataset@...
    rewards.N.name:     object:reward/my_reward
    model.name_or_path: object:model
    model.tokenizer:    object:tokenizer

The objects themselves live in this process, for the duration of one `train()` call (`given`). Resolving a
reference with no object behind it (a run's config.yaml given to the command line, a resume without the
object) is a one-line error naming what to pass. A dataset whose records differ from the fingerprint its
reference names is refused the same way; a changed fingerprint on resume is refused by
`checkpoint.check_resume_compatible` like any other change of `data.source`.

Deliberately not done: fingerprinting model weights (hashing a 7B model costs minutes); the model object is
trained in place, as TRL trains the model it is given.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, UserError

PREFIX = "object:"
REWARD_PREFIX = "reward/"
FINGERPRINT_CHARS = 16

# What the user passes to grpo_trainer.train() for each kind of reference (for messages).
ARGUMENTS = {
    "train_dataset": "train_dataset=",
    "eval_dataset": "eval_dataset=",
    "model": "model=",
    "tokenizer": "tokenizer=",
}


@dataclass(frozen=True)
class Records:
    """An in-memory dataset as the trainer reads it: column dicts, every record with every column."""

    rows: list[dict[str, Any]]
    fingerprint: str


@dataclass(frozen=True)
class ModelObject:
    """A model given in Python, and the frozen copy of it the KL term needs (taken before training starts, as
    the YAML path loads a second copy from disk; None when the run needs no reference)."""

    model: Any
    reference: Any = None


_objects: dict[str, Any] = {}  # reference name -> object, while a train() call runs
_models_handed_out: set[str] = set()


def reference(name: str, fingerprint: str | None = None) -> str:
    return f"{PREFIX}{name}" + (f"@{fingerprint}" if fingerprint else "")


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse(ref: str) -> tuple[str, str | None]:
    """`object:NAME@FINGERPRINT` -> (NAME, FINGERPRINT or None)."""
    name, _, fingerprint = ref[len(PREFIX) :].partition("@")
    return name, fingerprint or None


def what_to_pass(name: str) -> str:
    """How the user gives the object a reference names, e.g. `train_dataset=` or `my_reward in rewards=`."""
    if name.startswith(REWARD_PREFIX):
        return f"the reward function {name[len(REWARD_PREFIX) :]!r} in rewards="
    return ARGUMENTS.get(name, f"{name}=")


@contextlib.contextmanager
def given(objects: dict[str, Any]) -> Iterator[None]:
    """Make `objects` (reference name -> object) resolvable for the duration of the block."""
    saved, saved_handed = dict(_objects), set(_models_handed_out)
    _objects.clear()
    _objects.update(objects)
    _models_handed_out.clear()
    try:
        yield
    finally:
        _objects.clear()
        _objects.update(saved)
        _models_handed_out.clear()
        _models_handed_out.update(saved_handed)


def resolve(ref: str, where: str, error: type[UserError] = ConfigError) -> Any:
    """The object `ref` names, or `error` in one line saying what to pass."""
    name, fingerprint = parse(ref)
    if name not in _objects:
        raise error(
            f"{where}: {ref!r} names an object given to grpo_trainer.train() in Python, and none was given here: pass "
            f"{what_to_pass(name)} (a run given objects runs and resumes from Python, with the same objects)"
        )
    found = _objects[name]
    if fingerprint is not None and isinstance(found, Records) and found.fingerprint != fingerprint:
        raise error(
            f"{where}: the {name} given has fingerprint {found.fingerprint}, but the config names {fingerprint}: "
            f"its records differ from the run's"
        )
    return found


def records(ref: str, where: str, error: type[UserError]) -> list[dict[str, Any]]:
    found = resolve(ref, where, error)
    if not isinstance(found, Records):
        raise error(f"{where}: {ref!r} does not name a dataset")
    return list(found.rows)


def model(ref: str, where: str):
    """The model object itself the first time (the policy: trained in place), its frozen reference copy after."""
    found = resolve(ref, where)
    if not isinstance(found, ModelObject):
        raise ConfigError(f"{where}: {ref!r} does not name a model")
    if ref not in _models_handed_out:
        _models_handed_out.add(ref)
        return found.model
    return found.reference if found.reference is not None else copy.deepcopy(found.model)


def model_source(ref: str) -> str | None:
    """Where the model object given in this process was loaded from (its name_or_path), if it says."""
    found = _objects.get(parse(ref)[0]) if is_reference(ref) else None
    model = found.model if isinstance(found, ModelObject) else None
    source = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(source) if source else None


def tokenizer(ref: str, where: str):
    """A copy of the tokenizer object: the trainer sets its padding side and pad token, the caller's stays as it was."""
    return copy.deepcopy(resolve(ref, where))


def fingerprint(rows: list[dict[str, Any]]) -> str:
    """A digest of the records' content: the same records (in the same order) give the same fingerprint in any
    process, whatever object held them. Values JSON cannot hold are digested by their repr."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=repr, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:FINGERPRINT_CHARS]
