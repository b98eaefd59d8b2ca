"""Reading a config: the YAML file, dotted overrides, validation, and error messages that name the key."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from .base import _section_of
from .migrate import MOVED_KEYS, MigrationError, migrate
from .root import Config


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None), apply dotted overrides, validate."""
    data = read_config_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return config_from_dict(data, source=str(path) if path else "<defaults>")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a dict (not validated yet)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(loaded).__name__}")
    return loaded


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate a config's dict (the keys of earlier versions read into their places first, `migrate`)."""
    try:
        data, written = migrate(data)
        return Config.model_validate(data, context={"written": written})
    except MigrationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n  {exc.path}: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n" + _explain(exc, written)) from None


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; list items are addressed by index (`rewards.0.weight=2`)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. train.max_steps=50")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    set_dotted(data, key, value)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` to `value` (already parsed) in a nested dict; list items by index (`rewards.0.weight`).

    A mapping given for a mapping is merged into it key by key (`train={max_steps: 1}` changes max_steps and
    keeps the section's other keys); anything else (a list, a scalar, null) replaces what was there.
    """
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _child(node, part, parts[: i + 1], create=not parts[i + 1].isdigit())
    last: str | int = parts[-1]
    if isinstance(node, list):
        last = _index(node, parts[-1], parts)
    elif last not in node:
        node[last] = None
    node[last] = merged(node[last], value)


def merged(old: Any, new: Any) -> Any:
    """`new` over `old`: mappings merged key by key (recursively), anything else replaced. Copies `new`, so the
    caller's value is never changed by a later override."""
    if isinstance(old, dict) and isinstance(new, Mapping):
        return {**old, **{k: merged(old.get(k), v) for k, v in new.items()}}
    return copy.deepcopy(new)


def _child(node: Any, part: str, path: list[str], create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:-1])} is not a section")
    if part not in node or node[part] is None:
        if part == "rewards" and not create:
            # Overriding an item of the default reward list starts from the default list.
            node[part] = [r.model_dump() for r in Config().rewards]
        else:
            node[part] = {} if create else []
    return node[part]


def _index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {'.'.join(path)}: no list item {part} (the list has {len(node)} items)")
    return int(part)


def _explain(exc: ValidationError, written: Mapping[str, str]) -> str:
    """One line per error: the key's dotted path (as written, where `migrate` moved it) and what is wrong."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        if path in written:
            path = f"{written[path]} (now {path})"
        if err["type"] == "extra_forbidden" and path in MOVED_KEYS:
            msg = f"  {path}: moved to '{MOVED_KEYS[path]}'"
        elif err["type"] == "extra_forbidden":
            valid = _valid_keys(loc[:-1])
            hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            msg = f"  {path}: unknown key"
            msg += (
                f"; did you mean '{'.'.join(loc[:-1] + hint)}'?" if hint else f"; valid keys here: {', '.join(valid)}"
            )
        else:
            message = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            shown = "" if isinstance(given, dict) or err["type"] == "missing" else f" (got {given!r})"
            msg = f"  {path}: {message}{shown}" if path else f"  {message}"
        lines.append(msg)
    return "\n".join(lines)


def _valid_keys(loc: list[str]) -> list[str]:
    """The field names of the section at `loc` (list indices are skipped)."""
    model: type[BaseModel] = Config
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        section = _section_of(field.annotation) if field is not None else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)
