"""Bad input, tried as a new user would (issue 35, section 3): each is one clear line naming the key, file or
folder, before any model loads where it can, and loses nothing that was written.

Most tests run in this process with no model: the refusals come before one would load, and `build_run` is
replaced by a function that fails the test if it is reached. The two that need a real run (a second run into a
busy folder; a finished run run again) are marked slow.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo_trainer
from grpo_trainer import api, output_dir, trainer
from grpo_trainer import checkpoint as ckpt
from grpo_trainer.checkpoint import MANIFEST, METRICS_HISTORY, TRAINER_STATE, find_resume_checkpoint, verify
from grpo_trainer.config import Config, load_config
from grpo_trainer.errors import ConfigError, RewardError, TrainingError
from grpo_trainer.metrics import read_metrics
from grpo_trainer.rewards import Reward, compute_rewards
from helpers import ROOT, run_cli, small_run_overrides


@pytest.fixture
def no_model(monkeypatch):
    """trainer.train with build_run (the accelerator, the models) failing the test if it is reached; the
    trainer's logger as it was after (setup_logging stops it propagating, which caplog needs in later tests)."""
    import logging

    def build_run(cfg):
        raise AssertionError("build_run was reached: the check came after the model loads")

    monkeypatch.setattr(trainer, "build_run", build_run)
    logger = logging.getLogger("grpo_trainer")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


# ----------------------------------------------------------------------------- 1. one run per output_dir


def hold_in_a_child(folder: Path) -> tuple[int, int]:
    """A forked process holding `folder` (output_dir.claimed) until its stdin pipe closes: (pid, write end)."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: claim, say so, wait for the parent to close its end, exit without Python's teardown
        os.close(stop_w)
        os.close(ready_r)
        code = 0
        try:
            with output_dir.claimed(folder, share=lambda verdict: verdict):
                os.write(ready_w, b"1")
                os.read(stop_r, 1)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    return pid, stop_w


def test_a_busy_output_dir_is_refused_in_one_line_naming_the_folder_and_the_holder(tmp_path, no_model):
    folder = tmp_path / "run"
    pid, stop = hold_in_a_child(folder)
    try:
        with pytest.raises(ConfigError) as refused:
            trainer.train(load_config(None, [f"output_dir={folder}"]))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"output_dir: {folder} is in use by another run (pid {pid} on host ")
        assert "another output_dir" in message
    finally:
        os.close(stop)
        os.waitpid(pid, 0)
    assert not (folder / output_dir.LOCK_FILE).exists()  # released and removed at the holder's end
    with output_dir.claimed(folder):  # free again
        pass


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    """SIGKILL leaves the lock file (with a dead pid in it) but no lock: the kernel dropped it. A process the
    killed run had forked does not keep it either (its copy of the descriptor is closed at fork)."""
    folder = tmp_path / "run"
    ready_r, ready_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(ready_r)
        with output_dir.claimed(folder, share=lambda verdict: verdict):
            child = os.fork()  # e.g. a reward pool's worker, which outlives the run
            if child == 0:
                time.sleep(60)
                os._exit(0)
            os.write(ready_w, str(child).encode())
            time.sleep(60)
        os._exit(0)
    os.close(ready_w)
    orphan = int(os.read(ready_r, 32))
    os.close(ready_r)
    try:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        assert json.loads((folder / output_dir.LOCK_FILE).read_text())["pid"] == holder  # stale: its holder is dead
        with output_dir.claimed(folder):
            assert json.loads((folder / output_dir.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        os.kill(orphan, signal.SIGKILL)
    assert not (folder / output_dir.LOCK_FILE).exists()


def test_only_the_main_process_locks_and_every_rank_gets_its_verdict(tmp_path):
    folder = tmp_path / "run"
    pid, stop = hold_in_a_child(folder)
    try:
        with output_dir.claimed(folder, is_main_process=False, share=lambda verdict: verdict):
            pass  # another rank neither takes nor waits for the lock
        with pytest.raises(ConfigError, match="is in use by another run"):
            with output_dir.claimed(folder, is_main_process=False, share=lambda verdict: "output_dir: is in use by another run"):
                pass  # ... and stops with the main process's line
    finally:
        os.close(stop)
        os.waitpid(pid, 0)


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_folder_is_refused_and_the_first_finishes_intact(tmp_path, tiny_model_path):
    """Two runs into one output_dir at once: before the lock both exited 0 with two step series in one
    metrics.jsonl, one run's config.yaml and the other's model card. Now the second stops in one line, before
    loading a model, and the first run's files (metrics, config, checkpoint) are its own."""
    folder = tmp_path / "run"
    first: list = []
    thread = threading.Thread(target=lambda: first.append(run_cli(
        ["train", "configs/demo_cpu.yaml", *small_run_overrides(folder, steps=1), "seed=1",
         "checkpoint.save_final_model=false"],  # (the model card's plot costs seconds)
        # The first run holds the folder 6 s more, in its last save: the second (forked from a warm server, it
        # claims the folder before importing anything more) gets there first even on a loaded machine.
        env={"GRPO_TRAINER_PAUSE_IN_SAVE": "6"})))
    thread.start()
    lock = folder / output_dir.LOCK_FILE
    deadline = time.time() + 300
    while not (lock.is_file() and lock.read_text()) and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert lock.is_file() and lock.read_text(), first[0].stderr[-3000:] if first else "the first run never took the lock"
    holder = json.loads(lock.read_text())["pid"]
    second = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(folder, steps=2), "seed=2"])
    thread.join()
    assert first[0].returncode == 0, first[0].stderr[-3000:]
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"error: output_dir: {folder} is in use by another run (pid {holder} on host ")
    assert "world_size=" not in second.stderr  # stopped before the accelerator and the model
    assert [row["step"] for row in read_metrics(folder)] == [1]
    assert load_config(folder / "config.yaml").seed == 1
    assert json.loads((folder / "checkpoints" / "step-000001" / "trainer_state.json").read_text())["config"]["seed"] == 1
    assert not lock.exists()


# ----------------------------------------------------------------------------- 2. a mapping merges into its section


def test_a_section_given_as_a_mapping_changes_only_the_keys_it_names():
    """`train={max_steps: 1}` used to replace the whole train section: the demo's learning rate 2e-4 became the
    default 1e-6."""
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["train={max_steps: 1}"])
    assert (cfg.train.max_steps, cfg.train.learning_rate) == (1, 2e-4)
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["rewards.0={weight: 2}"])
    assert (cfg.rewards[0].name, cfg.rewards[0].weight) == ("math_accuracy", 2)
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["rewards=[{name: think_format}]"])  # a list replaces
    assert [r.name for r in cfg.rewards] == ["think_format"]
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["model.lora={r: 4}"])  # a mapping over null
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (4, 32)


def test_python_overrides_merge_the_same_way_and_leave_the_callers_dict_alone():
    data = api.config_data(ROOT / "configs" / "demo_cpu.yaml")
    given = {"train": {"max_steps": 1}, "train.prompts_per_step": 16}
    api._apply_overrides(data, given)
    cfg = Config.model_validate(data)
    assert (cfg.train.max_steps, cfg.train.prompts_per_step, cfg.train.learning_rate) == (1, 16, 2e-4)
    assert given == {"train": {"max_steps": 1}, "train.prompts_per_step": 16}


# ----------------------------------------------------------------------------- 3. output_dir


def test_an_empty_output_dir_is_refused_at_load():
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=r"output_dir: empty: name the folder the run writes to"):
            load_config(None, [f"output_dir={empty}"])


def test_an_output_dir_that_cannot_be_a_folder_is_one_line_before_the_model_loads(tmp_path, no_model):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for path, expected in [
        (a_file, f"output_dir: {a_file} is a file, not a folder"),
        (a_file / "run", f"output_dir: {a_file / 'run'} cannot be created: {a_file} is a file, not a folder"),
        (a_file / "deeper" / "run", f"output_dir: {a_file / 'deeper' / 'run'} cannot be created: {a_file} is a file"),
    ]:
        with pytest.raises(ConfigError) as refused:
            trainer.train(load_config(None, [f"output_dir={path}"]))
        assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    assert a_file.read_text() == "mine\n"


def test_an_output_dir_this_user_cannot_write_is_refused(tmp_path, monkeypatch, no_model):
    """Root may write anywhere but on a read-only file system, so the permission answer is faked here (the
    check asks os.access, as the kernel would answer a non-root user); creating the folder is the backstop."""
    parent = tmp_path / "shared"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == parent else real_access(path, mode, **kw))
    with pytest.raises(ConfigError) as refused:
        trainer.train(load_config(None, [f"output_dir={parent / 'run'}"]))
    assert str(refused.value) == f"output_dir: cannot write to {parent / 'run'}: {parent} is not writable by this user"
    assert not (parent / "run").exists()

    def read_only(self, *args, **kwargs):  # what a read-only mount answers root
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "access", real_access)
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=rf"^output_dir: cannot create {parent / 'run'}: Read-only file system$"):
        trainer.train(load_config(None, [f"output_dir={parent / 'run'}"]))


# ----------------------------------------------------------------------------- 8. a finished run, run again


def finished_checkpoint(folder: Path, cfg: Config, step: int, records: list[dict]) -> Path:
    """A checkpoint at `step` as the trainer publishes it (state, metrics history, manifest), and the final model."""
    checkpoint = folder / "checkpoints" / f"step-{step:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"step": step, "config": cfg.model_dump(mode="json")}))
    (checkpoint / METRICS_HISTORY).write_text("".join(json.dumps(r) + "\n" for r in records))
    write_manifest(checkpoint)
    (folder / "checkpoints" / "latest").write_text(checkpoint.name)
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    (folder / "model" / "README.md").write_text("the model card, written last")
    return checkpoint


def write_manifest(checkpoint: Path, **changes) -> None:
    files = {p.relative_to(checkpoint).as_posix(): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (checkpoint / MANIFEST).write_text(json.dumps({"files": {**files, **changes}}))


def test_a_finished_run_run_again_returns_its_final_metrics_without_loading_a_model(tmp_path, monkeypatch, no_model):
    cfg = load_config(None, [f"output_dir={tmp_path}", "train.max_steps=2"])
    records = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}]
    finished_checkpoint(tmp_path, cfg, 2, records)
    result = trainer.train(cfg)
    assert (result.steps_done, result.last_metrics, result.output_dir) == (0, records[-1], tmp_path)
    assert output_dir.finished_run(load_config(None, [f"output_dir={tmp_path}", "train.max_steps=1"])) == records[-1]
    # Not finished: more steps asked (found without hashing a file: resume verifies the checkpoint, once), starting
    # over, or the final model missing (resuming saves it).
    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "_sha256", lambda path: pytest.fail(f"{path} was hashed"))
        assert output_dir.finished_run(load_config(None, [f"output_dir={tmp_path}", "train.max_steps=3"])) is None
    assert output_dir.finished_run(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": "never"})})) is None
    # A change resuming refuses is refused here too: those metrics are another run's.
    with pytest.raises(TrainingError, match="loss.type: 'grpo' -> 'dapo'"):
        trainer.train(load_config(None, [f"output_dir={tmp_path}", "train.max_steps=2", "loss.type=dapo"]))
    (tmp_path / "model" / "README.md").unlink()  # killed in the middle of saving the final model
    assert output_dir.finished_run(cfg) is None


# ----------------------------------------------------------------------------- 9. manifests edited by hand


@pytest.fixture
def two_checkpoints(tmp_path):
    """Two intact checkpoints of a run (step 1 and step 2, `latest` naming step 2), with a file outside them."""
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    for step in (1, 2):
        checkpoint = tmp_path / "checkpoints" / f"step-{step:06d}"
        (checkpoint / "sub").mkdir(parents=True)
        (checkpoint / TRAINER_STATE).write_text(json.dumps({"step": step, "config": cfg.model_dump(mode="json")}))
        (checkpoint / "optimizer.bin").write_bytes(bytes(range(256)) * 8)
        (checkpoint / "sub" / "shard.bin").write_bytes(b"shard")
        write_manifest(checkpoint)
    (tmp_path / "checkpoints" / "latest").write_text("step-000002")
    (tmp_path / "secret").write_text("outside the checkpoint")
    return tmp_path, tmp_path / "checkpoints" / "step-000002"


def intact_manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())


@pytest.mark.parametrize("edit, problem", [
    (lambda m: {}, "not a checkpoint manifest"),  # the missing key was a KeyError
    (lambda m: [], "not a checkpoint manifest"),  # a list was a TypeError
    (lambda m: {"files": []}, "not a checkpoint manifest"),
    (lambda m: {"files": {}}, "does not list optimizer.bin (and 2 more files)"),  # vouched for every file unchecked
    (lambda m: {"files": {k: v for k, v in m["files"].items() if k != "optimizer.bin"}}, "does not list optimizer.bin,"),
    (lambda m: {"files": {**m["files"], "../../secret": m["files"]["optimizer.bin"]}}, "lists '../../secret', which is not"),
    (lambda m: {"files": {**m["files"], "/etc/hostname": m["files"]["optimizer.bin"]}}, "lists '/etc/hostname', which is not"),
    (lambda m: {"files": {**m["files"], "optimizer.bin": {"size": "2048", "sha256": "0" * 64}}}, "the entry of 'optimizer.bin' is not"),
    (lambda m: {"files": {**m["files"], "optimizer.bin": {"size": True, "sha256": "0" * 64}}}, "the entry of 'optimizer.bin' is not"),
    (lambda m: {"files": {**m["files"], "optimizer.bin": {"size": 2048}}}, "the entry of 'optimizer.bin' is not"),
    (lambda m: {"files": {**m["files"], "optimizer.bin": 5}}, "the entry of 'optimizer.bin' is not"),
])
def test_a_manifest_edited_by_hand_marks_its_checkpoint_damaged_and_resume_falls_back(two_checkpoints, edit, problem):
    run, checkpoint = two_checkpoints
    (checkpoint / MANIFEST).write_text(json.dumps(edit(intact_manifest(checkpoint))))
    found = verify(checkpoint)
    assert found is not None and found.startswith(f"{checkpoint / MANIFEST}: ") and problem in found, found
    assert find_resume_checkpoint(run, "auto") == (run / "checkpoints" / "step-000001",
                                                   [f"checkpoint step-000002 is damaged ({found}); trying an older one"])
    with pytest.raises(TrainingError, match="is damaged"):
        find_resume_checkpoint(run, str(checkpoint))


def test_a_truncated_file_the_manifest_no_longer_lists_is_caught(two_checkpoints):
    """`{"files": {}}` used to skip every check: a truncated optimizer file then failed deep in torch."""
    run, checkpoint = two_checkpoints
    (checkpoint / "optimizer.bin").write_bytes(b"trunc")
    write_manifest(checkpoint)  # re-listed as it is now: the manifest vouches for it, so it is "intact"
    assert verify(checkpoint) is None
    (checkpoint / MANIFEST).write_text('{"files": {}}')
    assert "does not list optimizer.bin" in verify(checkpoint)
    assert verify(run / "checkpoints" / "step-000001") is None


def test_hidden_files_a_desktop_or_a_copy_leaves_do_not_make_a_checkpoint_damaged(two_checkpoints):
    run, checkpoint = two_checkpoints
    (checkpoint / ".DS_Store").write_bytes(b"finder")
    (checkpoint / ".ipynb_checkpoints").mkdir()
    (checkpoint / ".ipynb_checkpoints" / "trainer_state-checkpoint.json").write_text("{}")
    assert verify(checkpoint) is None
    (checkpoint / "optimizer.2.bin").write_bytes(b"x")  # a file Accelerate could load by name: still damage
    assert "does not list optimizer.2.bin" in verify(checkpoint)


def test_a_path_leading_out_through_a_link_is_not_hashed(two_checkpoints):
    run, checkpoint = two_checkpoints
    (checkpoint / "sub" / "out").symlink_to(run / "secret")
    manifest = intact_manifest(checkpoint)
    manifest["files"]["sub/out"] = {"size": 22, "sha256": hashlib.sha256(b"outside the checkpoint").hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    assert "lists 'sub/out', which is not a path inside the checkpoint" in verify(checkpoint)


# ----------------------------------------------------------------------------- 10. the Python API's arguments


def test_a_model_given_as_a_string_is_the_models_name_or_path(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(trainer, "train", lambda cfg, on_step_end=None: seen.update(cfg=cfg))
    grpo_trainer.train(None, {"output_dir": str(tmp_path), "train.max_steps": 1}, model="builtin:tiny")
    assert seen["cfg"].model.name_or_path == "builtin:tiny" and seen["cfg"].model.tokenizer is None
    assert seen["cfg"].model.dtype == "float32"
    grpo_trainer.train(None, {"output_dir": str(tmp_path)}, model=tmp_path / "m", tokenizer=str(tmp_path / "t"))
    assert (seen["cfg"].model.name_or_path, seen["cfg"].model.tokenizer) == (str(tmp_path / "m"), str(tmp_path / "t"))


def test_what_is_not_a_causal_lm_or_an_override_is_refused_in_one_line(tmp_path, tiny_model_path, no_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for kwargs in ({}, {"tokenizer": tokenizer}):  # with a tokenizer it was AttributeError: 'Linear' ... 'config'
        with pytest.raises(ConfigError) as refused:
            grpo_trainer.train(None, [f"output_dir={tmp_path}"], model=torch.nn.Linear(3, 3), **kwargs)
        assert str(refused.value) == ("model: expected a causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)) or its "
                                      "Hub id or folder as a string; the Linear given has no `config` and has no `generate`")
    for overrides, message in [
        (5, "overrides: expected a list of KEY=VALUE strings or a dict, got int"),
        ([("train.max_steps", 1)], "overrides[0]: expected a KEY=VALUE string (e.g. 'train.max_steps=50'), got tuple"),
        ({3: 1}, "overrides: its keys are dotted config keys (e.g. 'train.max_steps'), got 3"),
    ]:
        with pytest.raises(ConfigError) as refused:
            grpo_trainer.train(None, overrides)
        assert str(refused.value).startswith(message)


# ----------------------------------------------------------------------------- 11. a bool is not a number, text is not a reward


@pytest.mark.parametrize("override", ["train.max_steps=true", "rollout.max_staleness=true", "seed=false",
                                      "train.learning_rate=true", "loss.tis_cap=true", "rewards.0.weight=true"])
def test_a_bool_where_a_number_is_asked_is_refused_naming_the_key(override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=rf"  {key}: expected a number, not {value} \(got {value.title()}\)"):
        load_config(ROOT / "configs" / "demo_cpu.yaml", [override, "rollout.engine=vllm_server"])


def test_yaml_numbers_that_pyyaml_reads_as_strings_still_load(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  learning_rate: 1e-4\nloss:\n  tis_cap: 2\n")  # PyYAML: '1e-4' is a string
    cfg = load_config(config, ["logging.progress_bar=false"])
    assert cfg.train.learning_rate == 1e-4 and cfg.loss.tis_cap == 2.0 and cfg.logging.progress_bar is False


PROMPTS = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]


def rewarded(value) -> list:
    batch = compute_rewards([Reward(name="r", fn=lambda completions, **kw: value)], PROMPTS, ["a", "b", "c"],
                            [[1], [2], [3]], {"prompt": PROMPTS})
    return [None if torch.isnan(v) else float(v) for v in batch.per_function[:, 0]]


@pytest.mark.parametrize("value", [
    [1, 0.5, None], (True, 0.5, float("nan")),
    torch.tensor([1.0, 0.5, float("nan")]), np.array([1.0, 0.5, np.nan]), np.array([1, 0.5, None], dtype=object),
    [np.float32(1), torch.tensor(0.5), np.array(None, dtype=object)],  # 0-d arrays and scalars
    torch.tensor([1.0, 0.5, float("nan")], dtype=torch.bfloat16), np.array([1.0, 0.5, np.nan], dtype=np.float16),
])
def test_every_array_type_of_numbers_is_a_reward(value):
    assert rewarded(value) == [1.0, 0.5, None]


@pytest.mark.parametrize("value, message", [
    (["1.0", 0.5, 0.0], "returned '1.0' for sample 0 (prompt: 'What is 1+1?'); expected a float or None"),
    ([1.0, "yes", 0.0], "returned 'yes' for sample 1"),
    (np.array(["1.0", "0.5", "0"]), "returned '1.0' for sample 0"),  # a NumPy array of text, element by element
    ([np.str_("1.0"), 0.5, 0.0], "returned '1.0' for sample 0"),
    ([1.0, b"1", 0.0], "returned b'1' for sample 1"),
    ([1.0, 1j, 0.0], "returned 1j for sample 1"),
    ([torch.tensor([1.0]), 0.5, 0.0], "returned a 1-d Tensor of shape (1,) for sample 0"),
    ([1.0, np.array([0.5, 0.5]), 0.0], "returned a 1-d ndarray of shape (2,) for sample 1"),
    (np.ones((3, 1)), "must return a list of 3 floats (or None), got a 2-d ndarray"),
    (torch.tensor(1.0), "must return a list of 3 floats (or None), got a 0-d Tensor"),
    (np.ones(2), "returned 2 values for 3 completions"),
])
def test_text_or_a_wrong_shape_is_not_a_reward_whatever_holds_it(value, message):
    with pytest.raises(RewardError) as refused:
        rewarded(value)
    assert message in str(refused.value)


def test_a_full_disk_while_taking_the_folders_lock_is_one_line(tmp_path, monkeypatch):
    """Writing the lock's record can fail like any write (ENOSPC, a quota): one line naming output_dir, shared with
    every rank (a raw OSError on the main process left the others waiting in the broadcast)."""
    import errno as errnos

    def full(*args):
        raise OSError(errnos.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_dir.os, "pwrite", full)
    shared = []
    with pytest.raises(ConfigError, match=f"output_dir: cannot write to {tmp_path / 'run'}: No space left on device"):
        with output_dir.claimed(tmp_path / "run", share=lambda verdict: shared.append(verdict) or verdict):
            pass
    assert shared and shared[0].startswith("output_dir: cannot write to")
    assert not (tmp_path / "run" / output_dir.LOCK_FILE).exists()  # released and removed
