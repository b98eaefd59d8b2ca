"""Keys of earlier versions read into today's places, as a dict-to-dict step before validation.

A config (a file with its overrides, a checkpoint's saved config) that uses an old key loads as if the new key
had been written, so earlier checkpoints still resume and compare. Someone who wrote an old key gets one
deprecation line per key and process; a resolved config of an earlier version lists every key at its default,
and those move silently.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from ..errors import UserError
from ..losses import LOSS_VARIANTS, loss_variant
from .rollout import VLLMServerConfig

logger = logging.getLogger("grpo_trainer")

# Old dotted key -> new dotted key. Tools are an environment (the built-in stateless one), so their keys live there.
RENAMED: dict[str, str] = {
    f"rollout.{key}": f"environment.{key}" for key in ("tools", "max_tool_turns", "tool_timeout", "tool_output_chars")
}
# Old dotted key -> new, refused at the old place with a message naming the new one: `rollout.vllm` holds the
# in-process engine's settings, which a server setting must not be mistaken for.
MOVED_KEYS = {f"rollout.vllm.{key}": f"rollout.vllm_server.{key}" for key in VLLMServerConfig.model_fields}
# The flat `loss.*` option keys of earlier versions: each moves to `loss.options.NAME` of the type that reads it
# (the registry's `legacy_keys`), so that row of the table depends on `loss.type`.
FLAT_OPTION_KEYS = frozenset(key for v in LOSS_VARIANTS.values() for key in v.legacy_keys)

_told: set[str] = set()


class MigrationError(ValueError):
    """An old key that cannot be read into its new place; `path` is the section the message is about."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


def migrate(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A copy of `data` with every old key at its new place, and new -> old for each key moved (error messages
    then name a key as it was written)."""
    data = copy.deepcopy(data)
    written: dict[str, str] = {}
    for old, new in RENAMED.items():
        if _move(data, old, new):
            written[new] = old
    loss = data.get("loss")
    if isinstance(loss, dict):
        written.update({f"loss.options.{name}": f"loss.{key}" for name, key in _flat_options(loss).items()})
    return data, written


def _move(data: dict[str, Any], old: str, new: str) -> bool:
    old_section, old_key = old.split(".")
    new_section, new_key = new.split(".")
    source = data.get(old_section)
    if not isinstance(source, dict) or old_key not in source:
        return False
    target = data.setdefault(new_section, {})
    if target is None:
        target = data[new_section] = {}
    if not isinstance(target, dict):
        return False  # validation reports the section
    if new_key in target:
        raise MigrationError(old, f"moved to {new}, which is set too: set only {new}")
    target[new_key] = source.pop(old_key)
    if old not in _told and target[new_key] != _default(new_section, new_key):
        _told.add(old)
        logger.warning("config key %s is deprecated: it is now %s (read as %s this time)", old, new, new)
    return True


def _default(section: str, key: str) -> Any:
    from .root import Config

    annotation = Config.model_fields[section].annotation
    assert isinstance(annotation, type)
    return annotation.model_fields[key].get_default(call_default_factory=True)


def _flat_options(loss: dict[str, Any]) -> dict[str, str]:
    """Move the flat option keys of `loss` into `loss["options"]`; option name -> the flat key it came from.

    Each type reads only its own options: another type's option would silently do nothing, so it is an error
    naming the types that read it. A flat key of another type at its default passes (a resolved config of an
    earlier version lists them all), and a flat key set to null means unset (epsilon_high, delta)."""
    spec = loss.get("type", "grpo")
    if not isinstance(spec, str):
        return {}
    flat = {key: loss.pop(key) for key in list(loss) if key in FLAT_OPTION_KEYS}
    try:
        variant = loss_variant(spec)
    except (ValueError, UserError):
        return {}  # `loss.type` reports it
    given = loss.get("options")
    if not flat or not (given is None or isinstance(given, dict)):
        return {}  # validation reports an options value that is not a mapping
    options = dict(given or {})
    moved = {}
    for key, value in flat.items():
        name = variant.legacy_keys.get(key)
        if name is None:
            if value is not None and not _is_flat_default(key, value):
                raise MigrationError(
                    "loss", f"{key} ({value}) is not used by type {spec}; it is read by: {_readers(key)}"
                )
        elif name in options:
            raise MigrationError(
                "loss", f"{key} and options.{name} are the same option of type {spec}: set only options.{name}"
            )
        elif value is not None:
            options[name] = value
            moved[name] = key
    if moved:
        loss["options"] = options
    return moved


def _readers(key: str) -> str:
    return ", ".join(v.name for v in LOSS_VARIANTS.values() if key in v.legacy_keys)


def _is_flat_default(key: str, value: Any) -> bool:
    """`value` is the default of the option a flat key stands for (in every type that reads it)."""
    return all(
        value == v.options.model_fields[v.legacy_keys[key]].default
        for v in LOSS_VARIANTS.values()
        if key in v.legacy_keys
    )
