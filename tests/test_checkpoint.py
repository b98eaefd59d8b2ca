"""Checkpoints: exact resume, atomic saves under SIGKILL, refusing incompatible resumes, export."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.metrics import read_metrics
from helpers import ROOT, assert_same_run, run_cli, small_run_overrides

def train(out, steps, *extra, launcher=None, env=None, resume="never"):
    overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
    result = run_cli(["train", "configs/demo_cpu.yaml", *overrides, f"checkpoint.resume={resume}", *extra], launcher=launcher, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize(
    "extra",
    [[], ["train.num_iterations=2"], ["train.mini_batches=2", "loss.top_entropy_quantile=0.5", "loss.advantage=rloo"]],
    ids=["mu1", "mu2", "mini_batches"],
)
@pytest.mark.slow
def test_stop_and_resume_is_bit_identical_to_a_straight_run(tmp_path, tiny_model_path, extra):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, 4, *extra)
    train(resumed, 2, *extra)
    log = train(resumed, 4, *extra, resume="auto").stderr
    assert "resumed from" in log and "at step 2" in log
    assert "changed on resume: train.max_steps: 2 -> 4" in log
    assert_same_run(straight, resumed)


@pytest.mark.slow
def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    overrides = [o for o in small_run_overrides(out, 6)] + ["checkpoint.save_every=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPO_TRAINER_PAUSE_IN_SAVE": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_trainer", "train", "configs/demo_cpu.yaml", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    staging = out / "checkpoints" / ".tmp-step-000002"
    try:
        deadline = time.time() + 300
        while not (staging / "model.safetensors").exists():  # the state is on disk, not yet published
            assert proc.poll() is None and time.time() < deadline, "training ended before its first save"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "checkpoints" / "step-000002").exists() and not (out / "checkpoints" / "latest").exists()

    # Now let the step-2 save complete, and kill during the step-4 one.
    env["GRPO_TRAINER_PAUSE_IN_SAVE"] = "0"
    train(out, 2, "checkpoint.save_every=2")
    env["GRPO_TRAINER_PAUSE_IN_SAVE"] = "60"
    resume_overrides = [o for o in small_run_overrides(out, 6) if "resume" not in o] + ["checkpoint.save_every=2", "checkpoint.resume=auto"]
    proc = subprocess.Popen([sys.executable, "-m", "grpo_trainer", "train", "configs/demo_cpu.yaml", *resume_overrides],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    staging = out / "checkpoints" / ".tmp-step-000004"
    try:
        deadline = time.time() + 300
        while not (staging / "model.safetensors").exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"

    log = train(out, 6, "checkpoint.save_every=2", resume="auto").stderr
    assert "at step 2" in log
    assert not staging.exists()  # the half-written save was cleaned up
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoints" / "latest").read_text() == "step-000006"


@pytest.mark.slow
def test_incompatible_resume_is_refused_and_compatible_changes_continue(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    train(out, 2)
    refused = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 3), "checkpoint.resume=auto",
                       "rollout.num_generations=2", "loss.type=dapo"])
    assert refused.returncode == 2
    assert "cannot resume" in refused.stderr and "rollout.num_generations: 4 -> 2" in refused.stderr
    assert "loss.type: 'grpo' -> 'dapo'" in refused.stderr and "checkpoint.force_resume=true" in refused.stderr
    log = train(out, 3, "train.learning_rate=5e-4", "logging.log_every=1", resume="auto").stderr
    assert "changed on resume: train.learning_rate: 0.001 -> 0.0005" in log
    forced = train(out, 4, "loss.type=dapo", "checkpoint.force_resume=true", resume="auto").stderr
    assert "(forced) loss.type" in forced


def _greedy(model, tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model.generate(**ids, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)[0].tolist()


@pytest.mark.slow
def test_export_reloads_and_generates_the_same_tokens(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer.export import load_checkpoint_model

    out = tmp_path / "run"
    train(out, 2)
    exported = tmp_path / "exported"
    result = run_cli(["export", str(out / "checkpoints" / "step-000002"), str(exported)])
    assert result.returncode == 0, result.stderr[-2000:]
    in_memory, tokenizer, _ = load_checkpoint_model(out / "checkpoints" / "step-000002")
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    assert _greedy(reloaded, AutoTokenizer.from_pretrained(exported)) == _greedy(in_memory.eval(), tokenizer)
    final = AutoModelForCausalLM.from_pretrained(out / "model")
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), reloaded.state_dict().values()))


@pytest.mark.slow
def test_lora_run_trains_only_adapters_and_exports_adapter_and_merged(tmp_path, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train(out, 2, "model.lora={r: 4, alpha: 8}", "loss.beta=0.05")
    # The reference is the policy with its adapters switched off; at step 1 nothing has been learnt (B = 0),
    # so the two are one model and the KL is exactly 0. Once step 1 has updated the adapters, it is not.
    rows = read_metrics(out)
    assert rows[0]["kl"] == 0.0
    assert rows[0]["frac_reward_zero_std"] == 1.0 or rows[1]["kl"] > 0
    base = load_file(tiny_model_path / "model.safetensors")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it trained

    assert run_cli(["export", str(out / "checkpoints" / "step-000002"), str(tmp_path / "adapter_only")]).returncode == 0
    assert (tmp_path / "adapter_only" / "adapter_config.json").is_file()
    assert run_cli(["export", str(out / "checkpoints" / "step-000002"), str(tmp_path / "merged"), "--merge"]).returncode == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "adapter_only").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, atol=1e-4, rtol=1e-4)
    # the merged weights moved away from the base: the adapters were not a no-op
    merged_weights = merged.state_dict()
    assert any(not torch.equal(base[k], merged_weights[k]) for k in base if k in merged_weights)


def test_settings_that_change_what_a_step_means_are_refused_on_resume():
    """The baseline and the optimizer steps per batch redefine the run, as the loss type does."""
    from grpo_trainer.checkpoint import check_resume_compatible
    from grpo_trainer.errors import TrainingError

    saved = {"loss": {"type": "grpo", "advantage": "grpo", "beta": 0.0}, "train": {"mini_batches": 1, "max_steps": 5}}
    for change in ({"loss": {**saved["loss"], "advantage": "rloo"}}, {"train": {**saved["train"], "mini_batches": 2}}):
        with pytest.raises(TrainingError, match="change what the run means"):
            check_resume_compatible(saved, {**saved, **change}, 1, 1, force=False)
    harmless = check_resume_compatible(saved, {**saved, "train": {**saved["train"], "max_steps": 9}}, 1, 1, force=False)
    assert harmless == [("train.max_steps: 5 -> 9", True)]


def test_what_a_change_on_resume_means_is_read_from_the_schema_flags():
    """Every leaf key of a resolved config gets its effect from its field or a section above it (config/'s
    CHANGES_MEANING / HARMLESS_ON_RESUME); the keys refused are the ones the run's samples and objective depend
    on. Moving a flag changes this list on purpose, and the test with it."""
    from grpo_trainer.checkpoint import flatten
    from grpo_trainer.config import load_config, resume_effect

    lora = load_config("configs/demo_cpu.yaml", ["model.lora={r: 4}"]).model_dump(mode="json")
    keys = flatten(lora)
    meaning = sorted({k.removeprefix("model.lora.").split(".")[0] if k.startswith("model.lora.") else k
                      for k in keys if resume_effect(k) == "meaning"} - {"r", "alpha", "dropout", "target_modules"})
    assert meaning == ["data.answer_column", "data.chat_template", "data.num_samples", "data.prompt_column",
                       "data.source", "data.split", "data.subset", "data.system_prompt", "data.use_chat_template",
                       "environment.action", "environment.action_tool", "environment.agent", "environment.factory",
                       "environment.max_turns", "environment.observation_chars", "environment.observation_field",
                       "environment.on_error", "environment.openenv", "environment.reward_weight", "environment.verifiers",
                      "loss.advantage", "loss.teacher_kl", "loss.teacher_only", "loss.type", "model.dtype",
                       "model.name_or_path", "rollout.num_generations", "seed", "teacher", "train.mini_batches",
                       "train.prompts_per_step"]
    assert resume_effect("model.lora.r") == resume_effect("model.lora") == "meaning"  # a flagged section, whole
    assert {k.split(".")[0] for k in keys if resume_effect(k) == "harmless"} == {"output_dir", "train", "eval",
                                                                                 "checkpoint", "logging"}
    assert [k for k in keys if k.startswith("train.") and resume_effect(k) == "harmless"] == ["train.max_steps"]
    assert resume_effect("eval.num_samples") == "harmless" and resume_effect("data.num_samples") == "meaning"
    assert resume_effect("train.learning_rate") is None  # allowed, with a warning
    assert resume_effect("loss.options.epsilon_high") is None and resume_effect("no.such.key") is None


def test_a_checkpoint_without_a_manifest_is_used_and_said_to_be_unverified(tmp_path):
    """Checkpoints written before manifests existed resume, with a note that nothing was verified."""
    from grpo_trainer.checkpoint import MANIFEST, TRAINER_STATE, find_resume_checkpoint

    folder = tmp_path / "checkpoints" / "step-000002"
    folder.mkdir(parents=True)
    (folder / TRAINER_STATE).write_text("{}")
    found, notes = find_resume_checkpoint(tmp_path, "auto")
    assert found == folder and notes == [f"checkpoint {folder} has no {MANIFEST}: its files are used unverified "
                                         "(no size or SHA-256 check)"]
    assert find_resume_checkpoint(tmp_path, str(folder))[1] == notes
    state = folder / TRAINER_STATE
    (folder / MANIFEST).write_text(json.dumps({"files": {TRAINER_STATE: {
        "size": state.stat().st_size, "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}}}))
    assert find_resume_checkpoint(tmp_path, "auto") == (folder, [])


def test_a_checkpoint_of_an_earlier_version_reports_only_real_changes_on_resume():
    """Its config's flat loss keys (loss.epsilon_low, ...) are read into today's loss.options before comparing,
    so resuming it says nothing changed (it said 'loss.epsilon_low: 0.2 -> None' for every flat key)."""
    from grpo_trainer.checkpoint import check_resume_compatible, resolved_today
    from grpo_trainer.config import load_config

    current = load_config("configs/demo_cpu.yaml").model_dump(mode="json")
    saved = json.loads(json.dumps(current))
    options = saved["loss"].pop("options")
    saved["loss"].update(epsilon_low=options["epsilon_low"], epsilon_high=options["epsilon_high"])
    assert any(note.startswith("loss.") for note, _ in check_resume_compatible(saved, current, 1, 1, force=False))
    assert check_resume_compatible(resolved_today(saved), current, 1, 1, force=False) == []
