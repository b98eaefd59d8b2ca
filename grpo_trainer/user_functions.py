"""Functions a user names in YAML, `path/to/file.py:function` or `package.module:function`: rewards and tools.

Both extension points find their functions by the same rules, here once: a file is imported once per process
(so the functions of one file share its module state), a module by its import path, and what goes wrong
(no such file, an import that raises, no such function, not callable) is one line naming the config key.
Each caller says what it is resolving (`kind`, for the messages) and which error type it raises.

Importing a user's file or module runs its code: it may hang (a blocking call at import time), exit, or os._exit.
So the import runs under the deadline utility (deadline.UserCalls), within `import_limit()` seconds
(GRPO_TRAINER_IMPORT_TIMEOUT, default 300: imports of torch-sized libraries take seconds, never minutes): a hang,
an exit or a raise is one line naming the config key, never a run that hangs or vanishes. The import runs in a
worker thread, so a module that installs a signal handler at import time (allowed in the main thread only) fails
there, in that same one line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UserError

_FILE_MODULES: dict[Path, Any] = {}
IMPORT_TIMEOUT_ENV = "GRPO_TRAINER_IMPORT_TIMEOUT"


def import_limit() -> float:
    """Seconds a user's file or module may take to import (GRPO_TRAINER_IMPORT_TIMEOUT, default 300)."""
    value = os.environ.get(IMPORT_TIMEOUT_ENV, "300")
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{IMPORT_TIMEOUT_ENV}={value!r} is not a number of seconds") from None


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
    module = _import_within_limit(module_part, spec, where, kind, error)
    fn = getattr(module, attr, None)
    if fn is None:
        raise error(f"{where}: {module_part!r} has no function {attr!r}")
    if not callable(fn):
        raise error(f"{where}: {spec!r} is not callable")
    return fn


def _import_within_limit(module_part: str, spec: str, where: str, kind: str, error: type[UserError]) -> Any:
    """The module of `module_part` (a file, imported once per process, or an import path), imported under the
    deadline utility (module docstring); what goes wrong is `error`, one line naming `where`."""
    from .deadline import call_alone

    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise error(f"{where}: {kind} file not found: {path}")
        if path.resolve() in _FILE_MODULES:
            return _FILE_MODULES[path.resolve()]
        load: Callable[[], Any] = lambda: _file_module(path, where, kind, error)  # noqa: E731
    else:
        load = lambda: importlib.import_module(module_part)  # noqa: E731
    limit = import_limit()
    outcome = call_alone(
        load, limit, name=f"{where} ({spec})", limit_key=IMPORT_TIMEOUT_ENV, stop=error, label="import"
    )
    if outcome.timed_out is not None:
        raise error(
            f"{where}: importing {module_part!r} for {kind} {spec!r} took longer than {limit:g}s (it hangs at "
            f"import time? {IMPORT_TIMEOUT_ENV} raises the limit)"
        )
    if not outcome.ok:
        raise error(f"{where}: importing {module_part!r} for {kind} {spec!r} failed: {outcome.error}")
    return outcome.value


def _file_module(path: Path, where: str, kind: str, error: type[UserError]):
    """Import a file once per process, so the functions of one file share its module state."""
    if not path.is_file():
        raise error(f"{where}: {kind} file not found: {path}")
    key = path.resolve()
    if key not in _FILE_MODULES:
        name = _module_name(key)
        module_spec = importlib.util.spec_from_file_location(name, key)
        if module_spec is None or module_spec.loader is None:  # not a file Python can import
            raise error(f"{where}: {kind} file {path} cannot be imported as a Python module")
        _FILE_MODULES[key] = exec_registered(module_spec)
    return _FILE_MODULES[key]


def exec_registered(module_spec: importlib.machinery.ModuleSpec) -> Any:
    """The module of `module_spec`, run under its name in sys.modules as `import` would (its classes can be
    pickled; dataclasses and typing look their module up there); unregistered again when running it fails."""
    loader = module_spec.loader
    if loader is None:
        raise ImportError(f"{module_spec.origin} cannot be imported as a Python module (no loader)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[module_spec.name]
        raise
    return module


def _module_name(path: Path) -> str:
    """The name a user's file is imported under, registered in sys.modules as an import would be: what its
    classes' `__module__` says, so that pickle finds them (a checkpoint saves environment objects with the
    batches sampled and not yet trained) and so that dataclasses and typing in the file work as in any module. The
    file's stem, and the path's hash when another file of that stem holds the name; the same file gets the
    same name in every process (a resumed run unpickles what the interrupted one saved)."""
    name = f"grpo_user_{path.stem}"
    taken = sys.modules.get(name)
    if taken is not None and Path(getattr(taken, "__file__", "") or "").resolve() != path:
        name += "_" + hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return name


def first_duplicate(names: list[str]) -> str | None:
    """The first name that occurs twice (rewards and tools are looked up by name: two of one name is an error)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None
