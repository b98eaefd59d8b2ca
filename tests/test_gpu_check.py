"""scripts/gpu_check.sh is run on the day a GPU is lent: its shell must parse and its Python check must run."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_gpu_check_script_parses_and_names_every_gpu_only_path():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for check in ("hf_bf16", "hf_compiled", "vllm_sleep", "deepspeed_bf16", "fsdp", "vllm_tp2", "vllm_nccl_push",
                  "vllm_gloo_push"):
        assert f"check {check} " in script or f"skip {check} " in script, check


def test_the_python_check_runs_on_cpu_in_its_small_shape(tmp_path, tiny_model_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--small", "--steps", "2", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT device=cpu" in result.stdout and out.is_file()
