"""Functions a user names in YAML, `path/to/file.py:function` or `package.module:function`: rewards and tools.

Both extension points find their functions by the same rules, here once: a file is imported once per process
(so the functions of one file share its module state), a module by its import path, and what goes wrong
(no such file, an import that raises, no such function, not callable) is one line naming the config key.
Each caller says what it is resolving (`kind`, for the messages) and which error type it raises.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UserError

_FILE_MODULES: dict[Path, Any] = {}


def resolve_function(
    spec: str, where: str, kind: str, error: type[UserError], builtins: Sequence[str] = ()
) -> Callable[..., Any]:
    """`path/to/file.py:fn` | `package.module:fn` -> the function; `error(message)` naming `where` otherwise.
    `builtins`: the names the caller resolves itself, listed in the message for a spec of neither form."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        named = f"a built-in {kind} ({', '.join(builtins)}) nor " if builtins else ""
        raise error(
            f"{where}: {spec!r} is not {named}of the form 'path/to/file.py:function' or 'package.module:function'"
        )
    try:
        module = (
            _file_module(Path(module_part), where, kind, error)
            if module_part.endswith(".py")
            else importlib.import_module(module_part)
        )
    except UserError:
        raise
    except Exception as exc:
        raise error(
            f"{where}: importing {module_part!r} for {kind} {spec!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise error(f"{where}: {module_part!r} has no function {attr!r}")
    if not callable(fn):
        raise error(f"{where}: {spec!r} is not callable")
    return fn


def _file_module(path: Path, where: str, kind: str, error: type[UserError]):
    """Import a file once per process, so the functions of one file share its module state."""
    if not path.is_file():
        raise error(f"{where}: {kind} file not found: {path}")
    key = path.resolve()
    if key not in _FILE_MODULES:
        module_spec = importlib.util.spec_from_file_location(f"grpo_user_{path.stem}", key)
        if module_spec is None or module_spec.loader is None:  # not a file Python can import
            raise error(f"{where}: {kind} file {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def first_duplicate(names: list[str]) -> str | None:
    """The first name that occurs twice (rewards and tools are looked up by name: two of one name is an error)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None
