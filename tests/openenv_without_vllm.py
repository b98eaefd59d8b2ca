"""Runs a script as a venv built by `make test VLLM=` would: every module of a distribution that only vLLM brings
into the venv (none of grpo-trainer[dev]'s own requirements, followed to the end) cannot be imported.
tests/test_openenv_overlay.py starts the OpenEnv test server through it, to check that the overlay's list
(.ci/openenv-overlay.txt) is complete on its own and does not borrow what vLLM happens to install.

    python tests/openenv_without_vllm.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import runpy
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _requirements(dist: importlib.metadata.Distribution, extras: tuple[str, ...]) -> list[Requirement]:
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            out.append(req)
    return out


def closure(root: str, extras: tuple[str, ...], installed: dict[str, importlib.metadata.Distribution]) -> set[str]:
    """The distributions `root[extras]` needs, followed through the installed ones."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    names: set[str] = set()
    stack = [(canonicalize_name(root), extras)]
    while stack:
        name, wanted = stack.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        names.add(name)
        if name in installed:
            stack += [(canonicalize_name(r.name), tuple(sorted(r.extras))) for r in _requirements(installed[name], wanted)]
    return names


def _modules(dist: importlib.metadata.Distribution) -> set[str]:
    """The dotted names of the modules and packages a distribution installed (from its file list)."""
    names = set()
    for file in dist.files or []:
        if file.parts[0].endswith((".dist-info", ".data")) or file.parts[0] == ".." or "__pycache__" in file.parts:
            continue
        if file.suffix == ".py" or file.suffix in (".so", ".pyd"):
            parts = [*file.parts[:-1], file.name.split(".")[0]]
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def vllm_only_modules(site_packages: list[str]) -> set[str]:
    """The modules in `site_packages` that only distributions grpo-trainer[dev] does not need installed. By module,
    not by top-level name: a namespace package (opentelemetry) is shared by ours and theirs."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=site_packages)}
    ours = closure("grpo-trainer", ("dev",), installed) | {"pip", "uv", "setuptools", "wheel"}
    ours |= {n for n in installed if n.startswith(("nvidia-", "torch"))}  # torch and what it brings, installed first
    theirs = set().union(*(_modules(d) for n, d in installed.items() if n not in ours))
    return theirs - set().union(*(_modules(d) for n, d in installed.items() if n in ours))


class Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, modules: set[str]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if any(".".join(parts[:i]) in self.modules for i in range(1, len(parts) + 1)):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


if __name__ == "__main__":
    import site

    venv = site.getsitepackages()
    # What the PYTHONPATH brings (the overlay, the tests) is not the venv's and stays importable.
    own = {entry.name.removesuffix(".py") for folder in sys.path[1:] if folder and folder not in venv
           and Path(folder).is_dir() and "site-packages" not in folder for entry in Path(folder).iterdir()}
    blocked = {name for name in vllm_only_modules(venv) if name.partition(".")[0] not in own}
    sys.meta_path.insert(0, Refuse(blocked))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
