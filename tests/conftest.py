"""Shared fixtures.

Markers: a test that starts processes (a CLI run, even forked; `accelerate launch`; a sandboxed program; a
script; a vLLM engine or server) or loads a real model is marked `slow`, per test or for its whole file.
`make test-fast` runs the rest (`-m "not slow"`), in this process; `make test` runs everything.

Workers (`make test` runs two, `--dist loadgroup`): the tests of a module that share a module-scoped fixture (a
training run, vLLM servers) are one `xdist_group`, so that fixture is built once, on one worker; a file's own
`xdist_group` mark (several files sharing a worker) comes first. Each worker, and every process it starts, gets
its share of the cores as torch/OpenMP threads: two workers of two threads each on two cores spent half their time
in OpenMP's spin-waits (tests/test_packing.py + test_losses.py + test_token_budget.py + test_golden.py: 49 s
with two threads a worker, 23 s with one, on this 2-core machine). A thread count set by the caller is kept.

Every process the tests start finds this venv's programs first on the PATH, as in an activated venv: DeepSpeed
builds its CPU ops with whichever `ninja` the PATH gives, and the venv's (1.13) and the system's (1.11) keep
incompatible build logs, so launches with and without the venv on the PATH rebuilt `shm_comm` (about a minute
of a core) each time they took turns.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """The venv first on the PATH; under xdist, this worker's share of the cores as threads (see the module
    docstring)."""
    venv_bin = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != venv_bin:
        os.environ["PATH"] = os.pathsep.join([venv_bin, os.environ.get("PATH", "")])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads  # what this worker starts inherits it
    import torch

    torch.set_num_threads(int(threads))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded tiny model, built once per machine (cached)."""
    from grpo_trainer.builtin import tiny

    return tiny.ensure_model()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks (its own collection hook)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group each module's tests that use one of its module-scoped fixtures (see the module docstring)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        definitions = item._fixtureinfo.name2fixturedefs  # pytest keeps no public map from a test to its fixtures
        if any(defs[-1].scope == "module" for defs in definitions.values()):
            item.add_marker(pytest.mark.xdist_group(f"module_fixture:{item.path.name}"))
