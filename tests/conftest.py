"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded tiny model, built once per machine (cached)."""
    from grpo_trainer.builtin import tiny

    return tiny.ensure_model()
