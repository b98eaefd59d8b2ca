"""Shared fixtures.

Markers: a test that starts processes (a CLI run, even forked; `accelerate launch`; a sandboxed program; a
script; a vLLM engine or server) or loads a real model is marked `slow`, per test or for its whole file.
`make test-fast` runs the rest (`-m "not slow"`), in this process; `make test` runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded tiny model, built once per machine (cached)."""
    from grpo_trainer.builtin import tiny

    return tiny.ensure_model()
