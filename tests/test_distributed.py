"""Multi-process runs on CPU: two real ranks over gloo, launched by `accelerate launch`."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_trainer.metrics import read_metrics
from helpers import ROOT, run_cli, small_run_overrides

ACCELERATE = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ROOT / "configs/accelerate/cpu_ddp.yaml")]


def launch(port: int) -> list[str]:
    return ACCELERATE + ["--main_process_port", str(port), "-m"]


def test_two_process_run_finishes_with_two_real_ranks(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    result = run_cli(
        ["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=2)],
        env={"ACCELERATE_USE_CPU": "1"},
        launcher=launch(29611),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # The trap this guards against: a "2-process" launch that silently runs one process.
    assert "world_size=2 distributed_type=MULTI_CPU" in result.stderr
    assert "prompts_per_rank=2" in result.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]  # one writer: the main process
    for row in rows:  # per-reward statistics cover both ranks, like `reward` (one reward, weight 1)
        assert abs(row["rewards/math_accuracy/mean"] - row["reward"]) < 1e-6
    assert (out / "model" / "model.safetensors").is_file()
