"""Faults that clusters and users produce, produced for real: each ends in one clear line, loses nothing that
was saved, and where the run continues, continues exactly (docs/troubleshooting.md, "Faults")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_trainer.config import RewardConfig
from grpo_trainer.errors import RewardError
from grpo_trainer.rewards import compute_rewards, load_rewards
from helpers import ROOT, assert_same_run, run_cli, small_run_overrides

PROMPTS = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]


def slow_rewards(tmp_path, source: str, **config) -> list:
    path = tmp_path / "slow.py"
    path.write_text(source)
    return load_rewards([RewardConfig(name=f"{path}:reward", **config)])


# The hanging rewards note when a hanging call ends (FINISHED): a score that returned while none had ended
# returned on the timeout, not because the hang was over. No clock is read.
SLEEPS_ON_SAMPLE_1 = (
    "import threading\n"
    "RELEASE, FINISHED = threading.Event(), []\n"
    "def reward(prompts, completions, **kwargs):\n"
    "    if any('2+2' in p for p in prompts):\n"
    "        RELEASE.wait(30)\n"
    "        FINISHED.append(len(prompts))\n"
    "    return [1.0] * len(prompts)\n"
)
ASYNC_SLEEPS_ON_SAMPLE_2 = (
    "import asyncio\n"
    "FINISHED = []\n"
    "async def reward(prompts, completions, **kwargs):\n"
    "    if any('3+3' in p for p in prompts):\n"
    "        await asyncio.sleep(30)\n"
    "        FINISHED.append(len(prompts))\n"
    "    return [1.0] * len(prompts)\n"
)


def hang_ended(rewards) -> bool:
    """Whether any call of the hanging reward ran to its end; releases the sync ones still waiting."""
    module = rewards[0].fn.__globals__
    ended = bool(module["FINISHED"])
    if "RELEASE" in module:
        module["RELEASE"].set()
    return ended


def score(rewards):
    return compute_rewards(rewards, PROMPTS, ["a", "b", "c"], [[1], [2], [3]], {"prompt": PROMPTS})


@pytest.mark.parametrize("source, sample", [(SLEEPS_ON_SAMPLE_1, 1), (ASYNC_SLEEPS_ON_SAMPLE_2, 2)], ids=["sync", "async"])
def test_a_hanging_reward_stops_the_run_naming_the_reward_and_the_sample(tmp_path, source, sample):
    rewards = slow_rewards(tmp_path, source, timeout=0.5)
    with pytest.raises(RewardError) as err:
        score(rewards)
    assert not hang_ended(rewards)  # stopped by the timeout (the batch call's, then the probes'), not the hang
    assert f"reward 'reward' did not return within 0.5 s (rewards.0.timeout) on sample {sample}" in str(err.value)
    assert "rewards.0.on_timeout=none" in str(err.value)


@pytest.mark.parametrize("source", [SLEEPS_ON_SAMPLE_1, ASYNC_SLEEPS_ON_SAMPLE_2], ids=["sync", "async"])
def test_on_timeout_none_scores_the_batch_none_and_counts_it(tmp_path, source):
    rewards = slow_rewards(tmp_path, source, timeout=0.5, on_timeout="none")
    batch = score(rewards)
    assert not hang_ended(rewards)
    assert batch.total.isnan().all()  # no opinion on any sample of that batch
    assert batch.metrics["rewards/reward/timed_out_batches"] == 1.0


def test_a_reward_within_its_timeout_is_unaffected(tmp_path):
    rewards = slow_rewards(tmp_path, "def reward(prompts, **kw):\n    return [0.5] * len(prompts)\n", timeout=5)
    batch = score(rewards)
    assert batch.total.tolist() == [0.5] * 3 and batch.metrics["rewards/reward/timed_out_batches"] == 0.0


# ----------------------------------------------------------------------------- preemption

def overrides(out, steps, resume="never", *extra):
    return [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")] + [
        f"checkpoint.resume={resume}", *extra]


def start(args, launcher=None, env=None):
    command = (launcher or [sys.executable, "-m"]) + ["grpo_trainer", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def wait_for(condition, proc, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def steps_logged(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_sigterm_saves_at_the_step_boundary_and_resume_is_bit_identical(tmp_path, tiny_model_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is saved, exit 75. A second SIGTERM arrives during that
    save (slowed by the test hook) and changes nothing. Resumed, the run equals one never interrupted."""
    from grpo_trainer.checkpoint import verify

    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    assert run_cli(["train", "configs/demo_cpu.yaml", *overrides(straight, 8)]).returncode == 0
    proc = start(["train", "configs/demo_cpu.yaml", *overrides(preempted, 8)], env={"GRPO_TRAINER_PAUSE_IN_SAVE": "2"})
    try:
        wait_for(lambda: steps_logged(preempted) >= 3, proc, "step 3")
        logged_at_signal = steps_logged(preempted)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any((preempted / "checkpoints").glob(".tmp-step-*")), proc, "the save")
        proc.send_signal(signal.SIGTERM)  # during the save
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr and "stopped by SIGTERM after step" in stderr
    step = steps_logged(preempted)
    # The run stops after the step under way when the signal came (steps may have ended since it was counted), and
    # its checkpoint, its last logged step and its own message agree on which.
    assert logged_at_signal <= step < 8 and f"after step {step}:" in stderr
    checkpoint = preempted / "checkpoints" / f"step-{step:06d}"
    assert (preempted / "checkpoints" / "latest").read_text() == checkpoint.name and verify(checkpoint) is None
    assert not (preempted / "model").exists()  # the run is not done: no final model

    resumed = run_cli(["train", "configs/demo_cpu.yaml", *overrides(preempted, 8, "auto")])
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr
    assert_same_run(straight, preempted)


@pytest.mark.slow
def test_two_ranks_under_accelerate_launch_stop_together_and_resume_exactly(tmp_path, tiny_model_path):
    """SIGTERM to `accelerate launch`, which forwards it to both ranks: both stop at one step with one checkpoint,
    and the two-rank resume is bit-identical to a two-rank run never stopped."""
    from helpers import accelerate_launch, cpu_launch_file, free_port

    launch_file, env = cpu_launch_file("ddp", tmp_path), {"ACCELERATE_USE_CPU": "1"}
    launcher = lambda: accelerate_launch(launch_file, "--main_process_port", str(free_port()))  # noqa: E731
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    done = run_cli(["train", "configs/demo_cpu.yaml", *overrides(straight, 6)], launcher=launcher(), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = start(["train", "configs/demo_cpu.yaml", *overrides(preempted, 6)], launcher=launcher(), env=env)
    try:
        wait_for(lambda: steps_logged(preempted) >= 2, proc, "step 2")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "stopped by SIGTERM after step" in stderr, stderr[-3000:]
    step = steps_logged(preempted)
    assert (preempted / "checkpoints" / "latest").read_text() == f"step-{step:06d}"
    resumed = run_cli(["train", "configs/demo_cpu.yaml", *overrides(preempted, 6, "auto")], launcher=launcher(), env=env)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(straight, preempted)


# ----------------------------------------------------------------------------- damaged checkpoints

@pytest.mark.slow
def test_a_truncated_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path, tiny_model_path):
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    assert run_cli(["train", "configs/demo_cpu.yaml", *overrides(straight, 6, "never", "checkpoint.save_every=2")]).returncode == 0
    assert run_cli(["train", "configs/demo_cpu.yaml", *overrides(damaged, 4, "never", "checkpoint.save_every=2")]).returncode == 0
    weights = damaged / "checkpoints" / "step-000004" / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)  # written back incompletely, after the save had completed
    result = run_cli(["train", "configs/demo_cpu.yaml", *overrides(damaged, 6, "auto", "checkpoint.save_every=2")])
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(notes) == 1 and f"{weights}: {size // 2} bytes, {size} written" in notes[0]
    assert "at step 2" in result.stderr and "Traceback" not in result.stderr
    assert_same_run(straight, damaged)


@pytest.mark.slow
def test_no_intact_checkpoint_stops_resume_export_and_eval_naming_the_file(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    assert run_cli(["train", "configs/demo_cpu.yaml", *overrides(out, 2)]).returncode == 0
    checkpoint = out / "checkpoints" / "step-000002"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern, same size
    weights.write_bytes(bytes(data))
    expected = f"{weights}: contents differ from what was written (SHA-256 mismatch)"
    for args in (["train", "configs/demo_cpu.yaml", *overrides(out, 4, "auto")],
                 ["export", str(checkpoint), str(tmp_path / "exported")],
                 ["eval", str(out / "config.yaml"), "--checkpoint", str(checkpoint), "eval.num_samples=2"]):
        result = run_cli(args)
        assert result.returncode == 2, (args[0], result.stderr[-2000:])
        assert expected in result.stderr and "Traceback" not in result.stderr, (args[0], result.stderr[-2000:])


# ----------------------------------------------------------------------------- full disk

@pytest.mark.slow
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_stops_clearly(tmp_path, tiny_model_path):
    """The output folder on a 4 MiB tmpfs in a private mount namespace: step 1's checkpoint (2.6 MB) fits,
    step 2's does not."""
    from grpo_trainer.checkpoint import verify

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("mount namespaces are not available here (unshare --mount)")
    mount, kept = tmp_path / "small_disk", tmp_path / "kept"
    mount.mkdir()
    train = " ".join([sys.executable, "-m", "grpo_trainer", "train", "configs/demo_cpu.yaml",
                      *overrides(mount / "run", 3, "never", "checkpoint.save_every=1")])
    script = (f"mount -t tmpfs -o size=4m tmpfs {mount} && {{ {train}; echo exit=$?; }}; "
              f"ls -a {mount}/run/checkpoints; cp -r {mount}/run {kept}")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "exit=2" in result.stdout, result.stdout + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert f"saving step 2 to {mount}/run/checkpoints/.tmp-step-000002 failed" in errors[0]
    assert "MiB free there; the previous checkpoint (step-000001) is intact" in errors[0]
    listing = result.stdout.split()
    assert "step-000001" in listing and not any(name.startswith(".tmp") for name in listing)  # partial folder removed
    assert (kept / "checkpoints" / "latest").read_text() == "step-000001"
    assert verify(kept / "checkpoints" / "step-000001") is None


# ----------------------------------------------------------------------------- bad data

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_records_no_reward_can_score_are_refused_or_skipped_and_counted(tmp_path, tiny_model_path):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]
    rows[2] = {"prompt": "What is 9+9?"}  # no answer: math_accuracy can never reward it
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    args = ["train", "configs/demo_cpu.yaml", *overrides(tmp_path / "run", 1), f"data.source={data}"]
    refused = run_cli(args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert ("data: 1 of 6 records (the first: record 2) have no value in column 'answer', which reward "
            "'math_accuracy' (rewards.0) reads") in refused.stderr
    skipped = run_cli([*args, "data.skip_invalid_rows=true"])
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "left out 1 of 6 records with no value in a column a reward reads (the first: record 2" in skipped.stderr


@pytest.mark.parametrize("content, expected", [
    ("", "has no records"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "c", answer: 3}\n',
     "data.jsonl, line 3: not valid JSON (Expecting property name enclosed in double quotes, column 17)"),
    ('{"prompt": "a", "answer": "1"}\n["not", "an", "object"]\n', "data.jsonl: record 1 is a JSON list, not an object of columns"),
], ids=["empty", "malformed-line", "not-an-object"])
@pytest.mark.slow
def test_bad_data_files_are_one_line_naming_the_file_and_line(tmp_path, content, expected, tiny_model_path):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    result = run_cli(["train", "configs/demo_cpu.yaml", *overrides(tmp_path / "run", 1), f"data.source={data}"])
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_finished_multi_process_run_is_kept_until_the_process_ends(monkeypatch):
    """Released when `train` returned, a two-rank run's DDP reducer destroyed its gloo process group after the other
    rank had exited, and that destructor could wait forever (a launch hung on a finished run): the run is kept for
    the CLI's exit without teardown. One process keeps nothing."""
    from grpo_trainer import distributed

    monkeypatch.setattr(distributed, "_KEPT_UNTIL_EXIT", [])
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.keep_until_exit("one process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.keep_until_exit("two ranks")
    assert distributed._KEPT_UNTIL_EXIT == ["two ranks"]
