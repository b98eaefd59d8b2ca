"""Building a built-in model once per machine: the cache, the lock, the staging folder, the canonical float settings.

Every built-in model is a folder under the cache (`$GRPO_TRAINER_CACHE`, default `~/.cache/grpo_trainer`)
named with its recipe's version (`tiny-v3`), so a changed recipe builds a new folder instead of reusing a
stale one. `cached_build` is the one way such a folder comes to exist: built in a staging folder beside it
and renamed into place, by one process per machine while the others (ranks, parallel tests) wait on a lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_TRAINER_CACHE", Path.home() / ".cache" / "grpo_trainer"))


def cached_build(folder_name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir() / folder_name`, first built by `build(staging_folder)` if this machine has none.

    Safe under races: one builder per machine (a file lock beside the folder); the others wait and then find
    the folder. Atomic: the build writes into a staging folder that is renamed into place when complete, so a
    crash or a failure mid-build leaves nothing half-built (the staging folder is removed).
    """
    target = cache_dir() / folder_name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{folder_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # built by another process while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{folder_name}-building-", dir=target.parent))
        try:
            build(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


# The build's float arithmetic, made the same on every x86 machine: ATen's AVX2 kernels even where AVX-512 is
# there (the two sum in different orders; vector IEEE arithmetic is the same on any AVX2 CPU), MKL's
# bitwise-reproducible COMPATIBLE branch (SSE2 without the approximate rcpps/rsqrtps), one thread, no oneDNN.
# COMPATIBLE is the only reproducible branch MKL honours on CPUs of every vendor: its documentation says the
# others (AVX2, AVX512, ...) are "available only for Intel processors", and elsewhere MKL silently takes its
# AUTO branch. Version 3 used MKL_CBWR=AVX2: built on an AMD EPYC and on an Intel Xeon, its weights differed
# (the Xeon's warm start scored mean@4 0.06 on the held-out sums, the EPYC's 0.25), and so did every golden
# number. A child process, since these settings are read when torch starts.
CANONICAL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def build_canonically(builder: str, folder: Path, threads: int = 1, **kwargs: int) -> None:
    """Call `builder` ("module:function", which takes the folder and `kwargs`) in a child process with
    `CANONICAL_ENV`, so the model it trains is the same on every machine. `threads` is there for the test that
    the result does not depend on it (tests/test_tiny.py); builds use one."""
    module, function = builder.split(":")
    code = (
        f"import sys, torch; torch.set_num_threads({int(threads)}); torch.backends.mkldnn.enabled = False; "
        f"from pathlib import Path; from {module} import {function}; {function}(Path(sys.argv[1]), **{kwargs!r})"
    )
    env = {**os.environ, **CANONICAL_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    result = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {builder} into {folder} failed:\n{result.stderr[-3000:]}")
