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


# DeepSpeed compiles its CPU ops (C++, `-O3 -march=native`) the first time a run needs them, into
# TORCH_EXTENSIONS_DIR: the shared-memory collectives for any multi-rank DeepSpeed launch, the CPU Adam for the
# zero3_offload launch file. On a fresh 2-core machine that is ~3.5 minutes of CPU, taken from the tests that
# need the ops, at full priority. Built here instead, by a process at the lowest priority started with the
# session, it runs in the cores' idle moments (a test waiting on a server, a launch waiting on its ranks); a
# test that needs an op before it is ready waits on torch's build lock and then loads the same build (the same
# compiler command, so nothing is built twice). The process is in a session of its own: an interrupted test
# run does not kill it mid-build (torch would then wait forever on the lock it left behind).
DEEPSPEED_OPS_PREBUILD = """
import os
os.nice(19)
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import CPUAdamBuilder  # what deepspeed.ops.adam.DeepSpeedCPUAdam builds
get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # what deepspeed.comm builds
CPUAdamBuilder().load()
"""


def pytest_sessionstart(session: pytest.Session) -> None:
    """`make test` (GRPO_TRAINER_PREBUILD_DEEPSPEED_OPS=1) starts DeepSpeed's CPU op builds in the background."""
    if os.environ.get("GRPO_TRAINER_PREBUILD_DEEPSPEED_OPS") != "1" or "PYTEST_XDIST_WORKER" in os.environ:
        return
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        return
    subprocess.Popen([sys.executable, "-c", DEEPSPEED_OPS_PREBUILD], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


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
