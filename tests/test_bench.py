"""Smoke tests of scripts/bench.py (our trainer's path for 2 steps, and the JSON it writes) and of
scripts/profile_step.py (the trainer's phases as profiler ranges, operators attributed to them).

The TRL side runs only where TRL is importable in this interpreter (the team venv does not have it;
docs/performance.md says how to make the separate TRL venv the benchmark uses).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark scripts in fresh processes

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "bench.py"
SMALL = ["--steps", "2", "--warmup", "1", "--reps", "1", "--prompts-per-step", "2", "--num-generations", "4",
         "--max-completion-length", "8", "--micro-batch-size", "4"]
RESULT_KEYS = {"median_step_time_s", "median_gen_time_s", "rollout_tokens_per_s", "train_tokens_per_s",
               "mean_completion_length", "peak_rss_mib", "steps_measured", "reps"}


def _bench(tmp_path, trainers, *extra):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--trainers", trainers, "--json", str(out), *SMALL, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_bench_ours_only(tmp_path):
    report, stdout = _bench(tmp_path, "ours", "--ours-set", "train.trim_host_memory=false")
    assert "| median step time (s) |" in stdout
    assert report["config"]["ours_overrides"] == ["train.trim_host_memory=false"] and "ours-set: train.trim" in stdout
    assert report["model"] == "tiny"
    assert report["config"]["completions_per_step"] == 8
    assert set(report["results"]) == {"ours"}
    ours = report["results"]["ours"]
    assert RESULT_KEYS <= set(ours)
    assert ours["steps_measured"] == 1 and ours["reps"] == 1
    assert ours["median_step_time_s"] > 0 and ours["train_tokens_per_s"] > 0 and ours["peak_rss_mib"] > 0
    assert 0 < ours["mean_completion_length"] <= 8
    run = report["per_run"]["ours"][0]
    assert len(run["steps"]) == 2 and {"step_time", "gen_time", "mean_length"} <= set(run["steps"][0])
    assert report["ratios_ours_over_trl"] == {}
    # Which machine the numbers hold for (issue 26): model, vector units, threads, load, both measured roofs.
    machine = report["machine"]
    assert machine["cpu_model"] and machine["aten_cpu_capability"] and machine["torch_threads"] >= 1
    assert len(machine["loadavg"]) == 3 and len(machine["loadavg_at_end"]) == 3
    assert machine["matmul_peak_gflop_s"] > 0 and machine["read_bandwidth_gb_s"] > 0
    assert "machine: " in stdout and "GFLOP/s" in stdout


def test_the_ratio_is_reported_for_every_alternating_pair_of_reps():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench

    def run(steps, rss):
        return {"steps": [{"step_time": t, "gen_time": t / 2} for t in steps], "peak_rss_mib": rss}

    runs = {"ours": [run([9, 1.0, 1.2, 1.1], 100), run([9, 2.0, 2.0, 2.0], 110)],
            "trl": [run([9, 4.0, 4.0, 4.0], 400), run([9, 5.0, 5.0, 5.0], 400)]}
    spread = bench.rep_ratios(runs, warmup=1)  # the first step of each run is dropped
    step = spread["median_step_time_s"]
    assert step["per_rep"] == [0.275, 0.4] and step["min"] == 0.275 and step["max"] == 0.4
    assert step["median"] == pytest.approx(0.3375)
    assert spread["peak_rss_mib"]["per_rep"] == [0.25, 0.275]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="VmHWM is read from Linux's /proc")
def test_a_runs_peak_rss_is_its_own_not_the_drivers(tmp_path):
    # The driver (here pytest) holds 400 MiB, written so that it is resident, while it runs a child that only
    # reports, as every bench run does at its end. On Linux the child's ru_maxrss (os.wait4, as the bench read it
    # before) starts at the driver's high-water mark, so it was >= 400 MiB; the child's own VmHWM, which the
    # bench reads now, is one interpreter's (~15 MiB).
    sys.path.insert(0, str(REPO / "scripts"))
    import bench

    held = b"\x01" * (400 * 2**20)
    assert bench.own_peak_rss_mib() >= 400
    child = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import bench; "
             "bench._write_result(Path(sys.argv[2]), [])")
    result = bench.run_child([sys.executable, "-c", child, str(REPO / "scripts"), str(tmp_path)], tmp_path,
                             dict(os.environ), "probe")
    del held
    assert 0 < result["peak_rss_mib"] < 100 and result["steps"] == [] and result["wall_s"] > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not importable in this interpreter")
def test_bench_both(tmp_path):
    report, _ = _bench(tmp_path, "ours,trl")
    assert set(report["results"]) == {"ours", "trl"}
    assert RESULT_KEYS <= set(report["results"]["trl"])
    assert report["ratios_ours_over_trl"]["median_step_time_s"] > 0
    assert len(report["ratio_spread_over_reps"]["median_step_time_s"]["per_rep"]) == 1


def test_profile_step_attributes_operators_to_the_trainer_phases():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "profile_step.py"), "--steps", "3", "--prompts-per-step", "2",
         # --top 12: on the tiny model the matrix multiplies' share is near the bookkeeping operators', so under
         # load (other jobs on the 2 cores) they once fell out of a top 3 behind as_strided, t and empty.
         "--num-generations", "4", "--top", "12",
         # The profiled step may draw only groups whose completions all score alike (advantage 0); skipped, its
         # update would be the optimizer step alone, with no matrix multiply to find.
         "--skip-zero-advantage", "false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "profiled steps=1" in out
    for phase in ("rollout", "reward", "update"):
        assert f"| {phase} |" in out  # the phase table, from timing/* in metrics.jsonl
    # Operators inside the rollout and update ranges: matrix multiplies are among the top ones there.
    for phase in ("rollout", "update"):
        section = out.split(f"\n{phase}: aten self time")[1].split("\n\n")[0]
        assert "aten::mm" in section or "aten::addmm" in section or "aten::bmm" in section, section


def test_vllm_pair_refuses_the_tiny_model_with_the_reason():
    proc = subprocess.run([sys.executable, str(BENCH), "--engine", "vllm"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "head_dim 24" in proc.stderr and "--model large" in proc.stderr


def test_ours_set_overrides_reach_ours_config_only():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench

    spec = bench.spec_of(bench.PRESETS["tiny"], "MODEL", ours_overrides=["train.trim_host_memory=false", "loss.beta=0.04"])
    data = bench.ours_config(spec, Path("OUT"))
    assert data["train"]["trim_host_memory"] is False and data["loss"]["beta"] == 0.04
    assert "trim_host_memory" not in bench.ours_config(bench.spec_of(bench.PRESETS["tiny"], "MODEL"), Path("OUT"))["train"]
