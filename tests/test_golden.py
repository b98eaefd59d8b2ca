"""The demo's first steps, number for number: a refactor of the loop must not change what it computes.

`tests/golden/demo_cpu_first5.json` holds every non-timing metric of the first 5 steps of
`configs/demo_cpu.yaml`. Written by the loop before the phase redesign (issue 12); rewritten on 2026-12-01
by the same commit's loop (6ba7fd5, before that session's changes) once the tiny model's build was made the
same on every machine (build.CANONICAL_ENV; the first file held the weights of one machine's CPU); rewritten
again by the same loop once that build was made vendor-independent (tiny v4: MKL's COMPATIBLE branch, since
the AVX2 branch is Intel-only and an AMD machine had built other weights), so that a refactor is checked
against numbers it did not produce. The demo loads the shipped weights (build.py), so these numbers held on an
AMD EPYC too (2026-12-02), where the recipe's own short builds give other bytes than on the Xeon. Floats are compared to 1e-6 relative (the golden file went through JSON;
everything else is exact).

Regenerate only when a change is *meant* to alter the numbers, and say why in the commit:
    .venv/bin/python tests/test_golden.py
"""

from __future__ import annotations

import hashlib
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
# The tiny model (v4) the golden file was made with: built on an Intel Xeon (AVX-512); the build is meant to
# give these bytes on every x86 machine with AVX2.
TINY_WEIGHTS_SHA256 = "811e7880a9e1af821102dac91d9f9b5de31c262690913d123394af4a2dc4aab7"
STEPS = 5


def run_demo_steps(output_dir: Path) -> list[dict]:
    # A fresh interpreter with the tiny model's canonical float settings (build.CANONICAL_ENV), read when torch
    # starts: the numbers are then those of x86 machines with AVX2 (checked on an Intel Xeon and an AMD EPYC), not
    # only of the one that wrote them.
    result = run_cli(["train", "configs/demo_cpu.yaml", f"output_dir={output_dir}", f"train.max_steps={STEPS}",
                      "logging.progress_bar=false", "checkpoint.save_final_model=false"],
                     env=CANONICAL_ENV, launcher=[sys.executable, "-m"])
    assert result.returncode == 0, result.stderr[-3000:]
    return [without_timing(r) for r in read_metrics(output_dir)]


def test_the_tiny_model_is_the_one_the_golden_file_was_made_with(tiny_model_path):
    """Checked on its own so that a build that is not portable to this CPU says so, instead of failing below
    as a change of the loop's numbers."""
    built = hashlib.sha256((Path(tiny_model_path) / "model.safetensors").read_bytes()).hexdigest()
    assert built == TINY_WEIGHTS_SHA256, (
        f"the tiny model built on this machine ({tiny_model_path}) has other weights than the one the golden file "
        "was made with: build.CANONICAL_ENV does not make the build portable to this CPU"
    )


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
