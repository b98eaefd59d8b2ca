"""scripts/gpu_check.sh is run on the day a GPU is lent: here it runs dry (DRY_RUN=1: each check prints its
command), and every command it would run is run for real where a CPU can: the Python check in its small
shape, each launch's training overrides through `validate`; the rest are parsed as they would be."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, load_script, run_cli

pytestmark = pytest.mark.slow  # a shell script and a training run in fresh processes


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, list[str]]:
    """check name -> its command, as the script would run it with this venv's python3 on the PATH (conftest.py)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    listed = {line.split()[1].rstrip(":") for line in lines if line.startswith(("CHECK ", "SKIP "))}
    assert listed == {"hf_bf16", "hf_bf16_packed", "hf_compiled", "vllm_sleep", "deepspeed_bf16", "fsdp", "vllm_tp2",
                      "vllm_nccl_push", "vllm_gloo_push", "vllm_lora_push", "vllm_pace", "async_k1"}
    return {line.split()[1]: shlex.split(line)[2:] for line in lines if line.startswith("CHECK ")}


def gpu_check_parser():
    return load_script("gpu_check").build_parser()


def test_every_python_check_parses_and_the_hf_one_runs_on_cpu_in_its_small_shape(commands, tmp_path, tiny_model_path):
    python_checks = {name: command for name, command in commands.items() if command[:2] == ["python3", "scripts/gpu_check.py"]}
    assert "hf_bf16" in python_checks
    parser = gpu_check_parser()
    for name, command in python_checks.items():
        parser.parse_args(command[2:])  # exits (fails the test) on an argument the script does not take
    out = tmp_path / "check.json"
    hf = python_checks["hf_bf16"][1:] + ["--small", "--steps", "2", "--json", str(out)]
    result = subprocess.run([sys.executable, *hf], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT device=cpu" in result.stdout and out.is_file()


def test_the_lora_push_check_parses(commands):
    command = commands.get("vllm_lora_push")
    if command is not None:  # listed as a SKIP where vLLM is not installed
        assert command[:2] == ["python3", "scripts/bench_lora_push.py"]
        load_script("bench_lora_push").build_parser().parse_args(command[2:])


def test_the_vllm_pace_check_parses(commands):
    command = commands.get("vllm_pace")
    if command is not None:  # listed as a SKIP where vLLM is not installed
        assert command[:2] == ["python3", "scripts/vllm_pace.py"]
        load_script("vllm_pace").build_parser().parse_args(command[2:])


def test_every_launch_check_names_a_shipped_file_and_a_valid_training_config(commands):
    launches = {name: command for name, command in commands.items() if command[:2] == ["accelerate", "launch"]}
    assert "fsdp" in launches
    for name, command in launches.items():
        assert (ROOT / command[command.index("--config_file") + 1]).is_file(), name
        train = command[command.index("grpo_trainer") + 1:]
        assert train[0] == "train", name
        validated = run_cli(["validate", *train[1:]])
        assert validated.returncode == 0, (name, validated.stderr[-2000:])
