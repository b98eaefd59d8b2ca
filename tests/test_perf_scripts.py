"""The measuring scripts behind docs/performance.md run and report what they claim (on the tiny model, seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the measuring scripts in fresh processes

REPO = Path(__file__).resolve().parent.parent


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_decode_roofline_reports_the_engine_against_both_roofs(tmp_path, tiny_model_path):
    out = tmp_path / "roofline.json"
    proc = run_script("scripts/decode_roofline.py", "--model", "builtin:tiny", "--rows", "4", "--context", "16",
                      "--reps", "2", "--rollouts", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["read_bandwidth_gb_s"] > 0 and report["matmul_peak_gflop_s"] > 0
    assert report["roofline_step_s"] >= report["weight_mib"] * 2**20 / (report["read_bandwidth_gb_s"] * 1e9) * 0.999
    assert 0 < report["engine_share_of_roofline"] and report["engine_tokens_per_s"] > 0
    assert "of the roofline" in proc.stdout
    # The second roof: the model's own products at this row count, and the step against it
    ceiling = report["linear_ceiling_gflop_s"] * 1e9
    assert ceiling > 0 and report["ceiling_roofline_step_s"] >= report["step_gflop"] * 1e9 / ceiling * 0.999
    assert report["engine_share_of_ceiling_roofline"] == pytest.approx(
        report["ceiling_roofline_step_s"] / (report["engine_step_s"] + report["sampler_s"]))
    # A whole rollout of the recipe's shapes against its bounds (at the peak, and with the ceiling's products)
    (rollout,) = report["rollouts"]
    assert rollout["tokens"] > 0 and rollout["seconds"] > 0
    assert 0 < rollout["bound_s"] and 0 < rollout["ceiling_bound_s"]  # no timed assert: a bound is not a target
    assert "compute bound at the square peak" in proc.stdout


def test_bf16_cpu_compares_both_dtypes(tiny_model_path):
    proc = run_script("scripts/bf16_cpu.py", "--model", "builtin:tiny", "--rows", "2", "--tokens", "16", "--top", "3", "--reps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.float32: forward + backward" in proc.stdout and "torch.bfloat16: forward + backward" in proc.stdout
    assert "bfloat16 / float32:" in proc.stdout


def test_memory_timeline_marks_every_phase_backward_and_optimizer_step(tmp_path, tiny_model_path):
    """scripts/memory_timeline.py on the tiny model, 2 steps: each step's phases, its backward passes and optimizer
    step are marked, the samples are real, and an override applies."""
    import ctypes

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")
    out = tmp_path / "timeline.json"
    proc = run_script("scripts/memory_timeline.py", "--model", "tiny", "--steps", "2", "--interval-ms", "1",
                      "--json", str(out), "train.skip_zero_advantage=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    marks = [name for _, name in report["marks"]]
    for name in ("rollout start", "update start", "update end", "backward start", "optimizer step start",
                 "optimizer step end"):
        assert marks.count(name) >= 2, (name, marks)  # both steps
    assert marks.count("backward start") == marks.count("backward end")
    fields = report["fields"]
    assert all(s[fields.index("rss")] > 0 and s[fields.index("in_use")] > 0 for s in report["samples"])
    assert "overrides=['train.skip_zero_advantage=false']" in proc.stdout and "| update start |" in proc.stdout
    assert "freed but kept in the heap" in proc.stdout
