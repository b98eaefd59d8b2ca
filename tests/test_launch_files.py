"""Every shipped GPU launch file in configs/accelerate/, launched as users launch it, on this CPU machine.

Each test takes the shipped file and changes only `num_processes` (to 2) and `use_cpu` (to true)
(`helpers.cpu_launch_file`), then trains 2 steps of the demo. DeepSpeed files are launched without
ACCELERATE_USE_CPU (it turns DeepSpeed off), DDP with it. FSDP cannot run on CPU (Accelerate 1.15 enables it
on GPUs only): its file must still parse as Accelerate parses it, and the trainer must refuse clearly.
`ddp.yaml` and `zero3.yaml` are launched with the README's two-node command, both "nodes" on this machine
over 127.0.0.1 (one launch covers the file and the multi-node path; one node with two ranks of the same files
runs in tests/test_sharding.py); `zero2.yaml` and `zero3_offload.yaml` on one node.

One more change, to `zero3_offload`'s DeepSpeed JSON: `zero_force_ds_cpu_optimizer: false`, so DeepSpeed steps the
trainer's own optimizer on the offloaded states instead of its C++ CPU Adam, which it JIT-compiles in every fresh
checkout (~2 min of a core: the largest single cost of `make test`). The offload of parameters and optimizer
states, what the file is about, runs as shipped; DeepSpeed's own CPU Adam is not exercised here.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from grpo_trainer.metrics import read_metrics
from helpers import ROOT, accelerate_launch, cpu_launch_file, free_port, launch_failure, run_cli, small_run_overrides

pytestmark = pytest.mark.slow  # accelerate launch, 2 ranks

LAUNCH_DIR = ROOT / "configs" / "accelerate"
DEEPSPEED_FILES = ["zero2", "zero3", "zero3_offload"]


def without_deepspeeds_cpu_adam(launch_file):
    """`launch_file` (a CPU copy) pointed at a copy of its DeepSpeed JSON that keeps the trainer's optimizer under
    offload (the module docstring says why)."""
    config = yaml.safe_load(launch_file.read_text())
    shipped = ROOT / config["deepspeed_config"]["deepspeed_config_file"]
    copy = launch_file.with_name(f"{shipped.stem}_trainer_optimizer.json")
    copy.write_text(json.dumps({**json.loads(shipped.read_text()), "zero_force_ds_cpu_optimizer": False}))
    config["deepspeed_config"]["deepspeed_config_file"] = str(copy)
    launch_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return launch_file


def train_two_steps(launch_file, out, env=None, extra=()):
    return run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=2), *extra],
                   launcher=accelerate_launch(launch_file, "--main_process_port", str(free_port())), env=env)


# Periodic evaluation in the same runs: under ZeRO-3 every rank must take part in gathering the model.
EVAL = ["eval.every=2", "eval.num_samples=4", "eval.num_generations=2"]


TWO_NODES = ["ddp", "zero3"]  # launched as two nodes (see the module docstring)
# zero3's run also scores with a learned reward model (tests/test_reward_model.py builds it), weighted beside
# math_accuracy: the policy is sharded, the reward model must not be (transformers partitions any model loaded
# while a ZeRO-3 config is live: its forward then fails on empty weights); every rank scores its own completions,
# in training and in the evaluation, with the same model.
REWARD_MODEL_ON = "zero3"


@pytest.mark.parametrize("name", ["ddp", *DEEPSPEED_FILES])
def test_each_shipped_launch_file_trains_two_steps(name, tmp_path, tiny_model_path):
    deepspeed = name != "ddp"
    if deepspeed:
        pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    env = None if deepspeed else {"ACCELERATE_USE_CPU": "1"}
    extra = list(EVAL)
    if name == REWARD_MODEL_ON:
        from test_reward_model import build_reward_model

        rm = build_reward_model(tmp_path / "rm")
        extra.append(f"rewards=[{{name: math_accuracy}}, {{model: '{rm}', weight: 0.5}}]")
    if name in TWO_NODES:
        log = train_two_steps_on_two_nodes(cpu_launch_file(name, tmp_path), out, env or {}, extra=extra)
    else:
        launch_file = cpu_launch_file(name, tmp_path)
        if name == "zero3_offload":
            launch_file = without_deepspeeds_cpu_adam(launch_file)
        result = train_two_steps(launch_file, out, env=env, extra=extra)
        assert result.returncode == 0, launch_failure(result)
        log = result.stderr
    # bf16 for DeepSpeed comes from the JSON, where DeepSpeed reads it; DDP runs in the model's dtype.
    kind, precision = ("DEEPSPEED", "bf16") if deepspeed else ("MULTI_CPU", "no")
    assert f"world_size=2 distributed_type={kind} device=cpu" in log and f"mixed_precision={precision} " in log
    assert "prompts_per_rank=2" in log  # two real ranks, not one process silently (the CPU trap)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]  # one writer: the main process
    for row in rows:  # per-reward statistics cover both ranks, like `reward` (their weighted sum)
        if name == REWARD_MODEL_ON:
            expected = row["rewards/math_accuracy/mean"] + 0.5 * row["rewards/reward_model/mean"]
            assert row["reward"] == pytest.approx(expected, abs=1e-5)
        else:
            assert abs(row["rewards/math_accuracy/mean"] - row["reward"]) < 1e-6
    assert "eval/reward/mean@2" not in rows[0] and "eval/reward/mean@2" in rows[1]
    assert 0 <= rows[1]["eval/math_accuracy/mean@2"] <= 1
    if name == REWARD_MODEL_ON:  # the same model, so the same scale, in training and evaluation
        assert rows[1]["eval/reward_model/mean@2"] == pytest.approx(rows[1]["rewards/reward_model/mean"], abs=1.0)
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", DEEPSPEED_FILES)
def test_deepspeed_precision_lives_in_the_json_only(name):
    """Accelerate refuses `mixed_precision` beside `deepspeed_config_file` (the crash this guards against)."""
    launch = yaml.safe_load((LAUNCH_DIR / f"{name}.yaml").read_text())
    assert "mixed_precision" not in launch
    ds = json.loads((ROOT / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds


def test_the_cpu_ddp_file_is_the_shipped_ddp_file_on_cpu(tmp_path):
    """configs/accelerate/cpu_ddp.yaml (the README's CPU command) may not drift from ddp.yaml."""
    derived = yaml.safe_load(cpu_launch_file("ddp", tmp_path).read_text())
    assert yaml.safe_load((LAUNCH_DIR / "cpu_ddp.yaml").read_text()) == derived


def test_fsdp_file_parses_as_accelerate_parses_it_and_is_refused_on_cpu(tmp_path, tiny_model_path):
    from accelerate.commands.config.config_args import load_config_from_file

    parsed = load_config_from_file(str(LAUNCH_DIR / "fsdp.yaml"))
    assert parsed.distributed_type.value == "FSDP" and parsed.mixed_precision == "bf16"
    assert parsed.fsdp_config["fsdp_version"] == 2
    result = train_two_steps(cpu_launch_file("fsdp", tmp_path), tmp_path / "run")
    assert result.returncode != 0
    assert "the Accelerate config asks for FSDP but Accelerate set up NO (Accelerate enables FSDP on GPUs only" in result.stderr
    assert "Traceback" not in result.stderr.split("error: the Accelerate config")[0][-2000:]


def train_two_steps_on_two_nodes(launch_file, out, env: dict, extra=()) -> str:
    """The README's multi-node command: one launch per node, each `--num_machines 2 --machine_rank R` with the
    main node's address, here both on this machine, one process each, sharing an output folder as a cluster
    shares a file system. Returns the main node's log."""
    port, nodes = free_port(), []
    for rank in (0, 1):
        command = accelerate_launch(launch_file, "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                                    "--main_process_ip", "127.0.0.1", "--main_process_port", str(port))
        command += ["grpo_trainer", "train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=2), *extra]
        nodes.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=_env(env)))
    logs = []
    for node in nodes:
        try:
            logs.append(node.communicate(timeout=600)[0])
        finally:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    return logs[0]


def _env(extra: dict) -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **extra}  # PATH: conftest.py


def test_a_failed_launch_is_told_rank_by_rank_with_native_aborts():
    """helpers.launch_failure on interleaved `[rankN]: ` stderr: each rank's traceback apart, and the lines of a rank
    that died natively (SIGABRT: no traceback), which the stderr's tail alone would not show."""
    import subprocess

    from helpers import launch_failure

    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):", "[rank1]: Traceback (most recent call last):",
        "[rank0]:   File \"a.py\", line 1", "[rank1]:   File \"b.py\", line 2",
        "terminate called after throwing an instance of 'c10::Error'", "  what():  pair.cc: Connection reset",
        "[rank1]: ValueError: rank one's", "[rank0]: RuntimeError: rank zero's", "x" * 4000,
    ])
    said = launch_failure(subprocess.CompletedProcess([], 1, "", stderr)).split("--- end of stderr ---")[0]
    assert "terminate called after throwing an instance of 'c10::Error'\n  what():  pair.cc: Connection reset" in said
    assert ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"a.py\", line 1\n"
            "[rank0]: RuntimeError: rank zero's") in said
    assert "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"b.py\", line 2\n[rank1]: ValueError: rank one's" in said
