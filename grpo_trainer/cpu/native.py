"""C kernels built once per machine with the system C compiler, for its CPU, cached beside the models.

A kernel's library is named by a hash of its source, the compiler's version and path, its flags and the CPU's
flags (`-march=native`), so a cache shared by different machines never loads another's build, and an edited
kernel is built again. The build writes to a temporary file and renames it into place: concurrent builders
(ranks, test workers) write the same bytes. Whoever uses a library checks it against torch before trusting it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .machine import cpu_info


class NoCompiler(OSError):
    """No C compiler here (CC, cc or gcc)."""


def compiled(name: str, source: str, flags: list[str]) -> ctypes.CDLL:
    """`source` built with `flags` into a shared library, loaded; raises NoCompiler, OSError or
    subprocess.SubprocessError where that fails (the caller says what it does instead)."""
    from ..builtin import cache_dir

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NoCompiler("no C compiler (CC, cc or gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    machine = " ".join(sorted(cpu_info()["flags"]))
    digest = hashlib.sha256("\0".join([source, version, compiler, *flags, machine]).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"{name}-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
            c_file = Path(tmp) / f"{name}.c"
            c_file.write_text(source)
            built = Path(tmp) / target.name
            command = [compiler, *flags, "-fPIC", "-shared", str(c_file), "-o", str(built), "-lm"]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: a concurrent builder writes the same bytes
    return ctypes.CDLL(str(target))
