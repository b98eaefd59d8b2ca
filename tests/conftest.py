"""Shared fixtures.

Markers: a test that starts processes (a CLI run, even forked; `accelerate launch`; a sandboxed program; a
script; a vLLM engine or server) or loads a real model is marked `slow`, per test or for its whole file.
`make test-fast` runs the rest (`-m "not slow"`), in this process; `make test` runs everything.

Workers (`make test` runs two, `--dist loadgroup`): the tests of a module that share a module-scoped fixture (a
training run, vLLM servers) are one `xdist_group`, so that fixture is built once, on one worker; a file's own
`xdist_group` mark (several files sharing a worker) comes first.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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
