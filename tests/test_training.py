"""End-to-end runs of the tiny model through the CLI, as a user would start them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.metrics import read_metrics
from helpers import run_cli, small_run_overrides

pytestmark = pytest.mark.slow  # training runs through the CLI

REQUIRED_METRICS = {
    "step", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "loss", "learning_rate", "step_time",
}


def test_two_steps_change_the_parameters_and_write_outputs(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world_size=1" in result.stderr

    before = load_file(tiny_model_path / "model.safetensors")
    after = load_file(out / "model" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, f"only {changed} changed"

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert REQUIRED_METRICS <= set(rows[0])
    assert 0.0 <= rows[0]["reward"] <= 1.0
    assert (out / "config.yaml").read_text().count("max_steps: 2") == 1
    assert (out / "model" / "tokenizer.json").is_file()

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model")  # loadable as a plain HF folder


def test_resume_continues_from_the_saved_step(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    first = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=2), "checkpoint.save_every=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["step"] == 2

    second = run_cli(
        ["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=3), "checkpoint.save_every=1", "checkpoint.resume=auto"]
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "at step 2" in second.stderr
    assert "done: 1 steps" in second.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text() == "step-000003"


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "def broken(completions, **kwargs):\n    raise ValueError('cannot score this')\n",
            "error: reward 'broken' raised ValueError: cannot score this on sample 0 (prompt:",
        ),
        ("def broken(completions, **kwargs):\n    return [1.0]\n", "error: reward 'broken' returned 1 values for 16 completions"),
    ],
    ids=["raises", "wrong-length"],
)
def test_a_misbehaving_reward_stops_the_run_with_a_clear_message(tmp_path, tiny_model_path, source, expected):
    reward_file = tmp_path / "bad_reward.py"
    reward_file.write_text(source)
    result = run_cli(
        ["train", "configs/demo_cpu.yaml", *small_run_overrides(tmp_path / "run"), f"rewards=[{{name: '{reward_file}:broken'}}]"]
    )
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_custom_reward_file_trains_alongside_a_builtin(tmp_path, tiny_model_path):
    reward_file = tmp_path / "brevity.py"
    reward_file.write_text("def brevity(completions, completion_ids, **kwargs):\n    return [-len(ids) / 100 for ids in completion_ids]\n")
    out = tmp_path / "run"
    rewards = f"rewards=[{{name: math_accuracy}}, {{name: '{reward_file}:brevity', weight: 0.5}}]"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=1), rewards])
    assert result.returncode == 0, result.stderr[-3000:]
    row = read_metrics(out)[0]
    assert row["rewards/brevity/mean"] < 0
    expected = row["rewards/math_accuracy/mean"] + 0.5 * row["rewards/brevity/mean"]
    assert abs(row["reward"] - expected) < 1e-5
