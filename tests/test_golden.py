"""The demo's first steps, number for number: a refactor of the loop must not change what it computes.

`tests/golden/demo_cpu_first5.json` holds every non-timing metric of the first 5 steps of
`configs/demo_cpu.yaml`, written on an Intel Xeon. Every machine compares with it, so it must hold on CPUs that
round differently (an AMD EPYC's canonical builds of the tiny model gave other bytes than the Xeon's), and the
next CI machine may be a kind nobody has tried. Why it does:
* The demo loads the shipped weights (build.py): the same bytes everywhere, whatever this CPU would build.
* The run takes build.CANONICAL_ENV's float settings, so different CPUs differ only in the last bits of some
  operations. Floats are compared to 1e-6 relative: far above what such rounding moves a metric in 5 steps,
  far below what any change of the computation moves it.
* A sampled token only changes where a uniform draw falls within rounding of a boundary of the cumulative
  probabilities: about 1e-7 of a draw each, a few thousand draws here.
The margin is tested, not argued: a run whose every weight is nudged by one ulp after every optimizer step (more
than reordered sums change) still matches the file at the tolerance, and a learning rate x1.01 does not.

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


REL_TOL = 1e-6
LEARNING_RATE = 2.0e-4  # configs/demo_cpu.yaml's


def run_demo_steps(output_dir: Path, *overrides: str, prelude: str = "") -> list[dict]:
    """A fresh interpreter with the tiny model's canonical float settings (build.CANONICAL_ENV, read when torch
    starts); `prelude`: Python run before the trainer (the tests simulate another CPU with it)."""
    start = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_module('grpo_trainer', run_name='__main__')"
    launcher = [sys.executable, "-c", f"{prelude}\n{start}"] if prelude else [sys.executable, "-m"]
    result = run_cli(["train", "configs/demo_cpu.yaml", f"output_dir={output_dir}", f"train.max_steps={STEPS}",
                      "logging.progress_bar=false", "checkpoint.save_final_model=false", *overrides],
                     env=CANONICAL_ENV, launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    return [without_timing(r) for r in read_metrics(output_dir)]


def differences(golden: list[dict], got: list[dict]) -> list[str]:
    """Every metric of `got` that differs from the golden file beyond the tolerance, as one line each."""
    assert len(got) == len(golden) == STEPS
    found = []
    for step, (want, have) in enumerate(zip(golden, got), start=1):
        assert sorted(have) == sorted(want), f"step {step}: metric keys differ: {set(have) ^ set(want)}"
        for key, value in want.items():
            if isinstance(value, float) and not isinstance(have[key], bool):
                same = math.isclose(have[key], value, rel_tol=REL_TOL, abs_tol=1e-9)
            else:
                same = have[key] == value
            found += [] if same else [f"step {step} {key}: {have[key]!r} != {value!r}"]
    return found


def test_the_tiny_model_is_the_one_the_golden_file_was_made_with(tiny_model_path):
    """Checked on its own so that a build that is not portable to this CPU says so, instead of failing below
    as a change of the loop's numbers."""
    built = hashlib.sha256((Path(tiny_model_path) / "model.safetensors").read_bytes()).hexdigest()
    assert built == TINY_WEIGHTS_SHA256, (
        f"the tiny model built on this machine ({tiny_model_path}) has other weights than the one the golden file "
        "was made with: build.CANONICAL_ENV does not make the build portable to this CPU"
    )


def test_demo_metrics_match_the_golden_file(tmp_path, tiny_model_path):
    assert differences(json.loads(GOLDEN.read_text()), run_demo_steps(tmp_path / "demo")) == []


def test_the_tolerance_holds_another_cpus_rounding_and_catches_a_real_change(tmp_path, tiny_model_path):
    """A CPU that rounds differently (simulated: every weight one ulp up or down after every optimizer step)
    matches the golden file; the learning rate x1.01 does not (several metrics from step 2 on)."""
    golden = json.loads(GOLDEN.read_text())
    nudge = "from grpo_trainer.builtin.build import nudge_after_every_step; nudge_after_every_step(seed=1)"
    other_cpu = run_demo_steps(tmp_path / "other_cpu", prelude=nudge)
    assert differences(golden, other_cpu) == []
    moved = [h[k] != v for w, h in zip(golden, other_cpu) for k, v in w.items() if isinstance(v, float)]
    assert any(moved)  # the nudge reached the trainer's optimizer (1.7e-7 at most, measured on an AMD EPYC)
    changed = differences(golden, run_demo_steps(tmp_path / "lr", f"train.learning_rate={LEARNING_RATE * 1.01}"))
    assert len(changed) >= 3, changed


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_demo_steps(Path(tmp) / "demo")
    GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({len(rows)} steps)")
