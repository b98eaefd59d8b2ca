"""The demo's first steps, number for number: a refactor of the loop must not change what it computes.

`tests/golden/demo_cpu_first5.json` holds every non-timing metric of the first 5 steps of
`configs/demo_cpu.yaml`, written by a loop other than the one under test (6ba7fd5's, which predates the
phase structure), so that a refactor is checked against numbers it did not produce, and with the tiny
model's canonical build and float settings (build.CANONICAL_ENV), meant to make them those of any x86
machine with AVX2 rather than of one CPU. Floats are compared to 1e-6 relative (the golden file went through JSON; everything else is exact).

Regenerate only when a change is *meant* to alter the numbers, and say why in the commit:
    .venv/bin/python tests/test_golden.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from grpo_trainer.metrics import read_metrics
from grpo_trainer.builtin.build import CANONICAL_ENV
from helpers import run_cli, without_timing

pytestmark = pytest.mark.slow  # the demo in a fresh interpreter

GOLDEN = Path(__file__).parent / "golden" / "demo_cpu_first5.json"
STEPS = 5


def run_demo_steps(output_dir: Path) -> list[dict]:
    # A fresh interpreter with the tiny model's canonical float settings (build.CANONICAL_ENV), read when torch
    # starts: the numbers are then those of any x86 machine with AVX2, not only of the one that wrote them.
    result = run_cli(["train", "configs/demo_cpu.yaml", f"output_dir={output_dir}", f"train.max_steps={STEPS}",
                      "logging.progress_bar=false", "checkpoint.save_final_model=false"],
                     env=CANONICAL_ENV, launcher=[sys.executable, "-m"])
    assert result.returncode == 0, result.stderr[-3000:]
    return [without_timing(r) for r in read_metrics(output_dir)]


def test_demo_metrics_match_the_golden_file(tmp_path, tiny_model_path):
    golden = json.loads(GOLDEN.read_text())
    got = run_demo_steps(tmp_path / "demo")
    assert len(got) == len(golden) == STEPS
    for step, (want, have) in enumerate(zip(golden, got), start=1):
        assert sorted(have) == sorted(want), f"step {step}: metric keys differ: {set(have) ^ set(want)}"
        for key, value in want.items():
            if isinstance(value, float) and not isinstance(have[key], bool):
                assert math.isclose(have[key], value, rel_tol=1e-6, abs_tol=1e-9), f"step {step} {key}: {have[key]} != {value}"
            else:
                assert have[key] == value, f"step {step} {key}: {have[key]!r} != {value!r}"


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_demo_steps(Path(tmp) / "demo")
    GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({len(rows)} steps)")
