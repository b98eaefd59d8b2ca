"""What a user watches: metrics in jsonl and tensorboard, completion samples, eval and plot on a real run, guards."""

from __future__ import annotations

import json

import pytest

from grpo_trainer.metrics import read_metrics
from helpers import ROOT, run_cli, small_run_overrides

pytestmark = pytest.mark.slow  # a training run through the CLI


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("observed") / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=4),
                      "logging.report_to=[jsonl, tensorboard]", "logging.completions_every=2",
                      "logging.print_completions=true", "eval.every=2", "eval.num_samples=6"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_jsonl_and_tensorboard_hold_the_same_metrics(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = observed_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("timing/rollout", "timing/reward", "timing/logprobs", "timing/update", "timing/weight_sync",
                "timing/checkpoint", "entropy", "clip_ratio/region_mean", "completions/mean_length_correct"):
        assert key in rows[-1], key
    assert "eval/math_accuracy/pass@4" in rows[1] and "eval/math_accuracy/pass@4" not in rows[0]

    event_dirs = [p.parent for p in (out / "trackers").rglob("events.out.tfevents.*")]
    assert event_dirs, "no tensorboard event file"
    events = EventAccumulator(str(event_dirs[0]))
    events.Reload()
    rewards = events.Scalars("reward")
    assert [e.step for e in rewards] == [1, 2, 3, 4]
    assert [round(e.value, 5) for e in rewards] == [round(r["reward"], 5) for r in rows]
    assert "eval/reward/mean@4" in events.Tags()["scalars"]


def test_completion_samples_are_written_and_printed(observed_run):
    out, result = observed_run
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 2, 2, 4, 4, 4, 4]
    assert all({"prompt", "completion", "reward", "advantage"} <= set(s) for s in samples)
    assert "completions at step 4:" in result.stderr and "| reward | advantage" in result.stderr


def test_a_plain_run_prints_what_moves_and_no_alarms(observed_run):
    """A one-process CPU run: no DeepSpeed (unused) banner, no alarm about the tied embeddings at the checkpoint,
    and per step what moves (reward, length, entropy without KL or clipping), not GRPO's ~0 loss."""
    out, result = observed_run
    assert "Setting accelerator to CPU" not in result.stderr and "deepspeed" not in result.stderr.lower()
    assert "Removed shared tensor" not in result.stderr
    steps = [line for line in result.stderr.splitlines() if line.startswith("[grpo_trainer] step ")]
    assert len(steps) == 4 and all(" reward=" in s and " len=" in s and " entropy=" in s for s in steps)
    assert not any("loss=" in s for s in steps)


def next_commands(result) -> dict[str, list[str]]:
    """The commands a finished run prints after `next:`, by subcommand, as grpo_trainer's arguments."""
    lines = result.stdout.split("next:\n", 1)[1].splitlines()
    commands = [line.split("#")[0].split() for line in lines if line.strip()]
    assert all(c[1:3] == ["-m", "grpo_trainer"] and (ROOT / c[0]).is_file() for c in commands), commands
    return {c[3]: c[4:] for c in commands}


def test_eval_and_plot_commands_on_the_run(observed_run):
    """The commands the run prints at its end, run as printed (eval on fewer samples)."""
    out, result = observed_run
    commands = next_commands(result)
    assert commands == {"plot": [str(out)], "eval": [str(out / "config.yaml"), "--checkpoint", str(out / "model")]}
    evaluated = run_cli(["eval", *commands["eval"], "eval.num_samples=4", "--k", "2"])
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    values = dict(line.split(": ") for line in evaluated.stdout.splitlines() if line.startswith("eval/"))
    assert float(values["eval/num_prompts"]) == 4
    assert 0 <= float(values["eval/math_accuracy/mean@2"]) <= float(values["eval/math_accuracy/pass@2"]) <= 1

    plotted = run_cli(["plot", *commands["plot"]])
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    import matplotlib.image as mpimg

    pngs = [line for line in plotted.stdout.splitlines() if line.endswith(".png")]
    assert any(p.endswith("reward.png") for p in pngs) and any(p.endswith("eval.png") for p in pngs)
    image = mpimg.imread(next(p for p in pngs if p.endswith("reward.png")))
    assert image.shape[0] > 200 and image.shape[1] > 200 and image.std() > 0.01  # a picture, not a blank


def test_nonfinite_updates_are_skipped_then_the_run_stops(tmp_path, tiny_model_path):
    # A reward on an absurd scale: unscaled advantages of +-3e38 overflow the gradient norm to inf.
    reward_file = tmp_path / "huge.py"
    reward_file.write_text("def huge(completions, **kwargs):\n    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]\n")
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(tmp_path / "run", steps=8),
                      f"rewards=[{{name: '{reward_file}:huge'}}]", "loss.scale_rewards=none", "train.max_consecutive_nonfinite=2"])
    assert result.returncode == 2
    assert "optimizer step skipped (1 in a row)" in result.stderr
    assert "3 optimizer steps in a row had a non-finite loss or gradient" in result.stderr
    assert "train.max_consecutive_nonfinite=2" in result.stderr and "Traceback" not in result.stderr
    rows = read_metrics(tmp_path / "run")
    assert [r["nonfinite_skipped"] for r in rows] == [1, 1]  # the two skipped steps were logged, then it stopped


SAVE_IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo_trainer.export import save_model
model, out = sys.argv[1], Path(sys.argv[2])
save_model(AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model), out)
print("deepspeed imported:", "deepspeed" in sys.modules)
"""


ASSEMBLE_A_BUILTIN_IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
from grpo_trainer.builtin import tiny
from grpo_trainer.builtin.build import shipped_weights
tiny.build_model(Path(sys.argv[1]), weights=shipped_weights(tiny.FOLDER))
print("deepspeed imported:", "deepspeed" in sys.modules)
"""


def test_a_fresh_machines_first_run_assembles_the_tiny_model_without_importing_deepspeed(tmp_path):
    """The first run on a machine assembles builtin:tiny inside the user's process (build.cached_build): no
    DeepSpeed import, no banner, for a model nobody shards."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    result = subprocess.run([sys.executable, "-c", ASSEMBLE_A_BUILTIN_IN_A_FRESH_PROCESS, str(tmp_path / "tiny")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("deepspeed imported: False")
    assert "Setting accelerator" not in result.stderr and (tmp_path / "tiny" / "model.safetensors").is_file()


def test_saving_a_model_in_a_run_without_deepspeed_does_not_import_it(tiny_model_path, tmp_path):
    """transformers' save_pretrained would import DeepSpeed (installed here) only to check that the model is not
    one of its engines: 2 s and a banner at the end of every plain run. The saved folder is the model."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    pytest.importorskip("deepspeed")
    result = subprocess.run([sys.executable, "-c", SAVE_IN_A_FRESH_PROCESS, str(tiny_model_path), str(tmp_path / "saved")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("deepspeed imported: False")
    saved, original = load_file(tmp_path / "saved" / "model.safetensors"), load_file(tiny_model_path / "model.safetensors")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
