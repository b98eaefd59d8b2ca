"""wandb (offline), trackio and mlflow (a local file store), each run for real by one training run, read back from
what it wrote on disk: every step's metrics, the config, and the sample tables. Nothing leaves the machine."""

from __future__ import annotations

import json
import sqlite3
import struct
import tomllib
from pathlib import Path

import pytest

from grpo_trainer import trackers
from grpo_trainer.metrics import read_metrics
from helpers import ROOT, run_cli, small_run_overrides

STEPS = 4
SAMPLED_STEPS = [2, 4]  # logging.completions_every=2
PROJECT = "tracked"
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": ""}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("trackers")
    out = root / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=STEPS),
                      "logging.report_to=[jsonl, wandb, trackio, mlflow]", f"logging.project={PROJECT}",
                      "logging.completions_every=2"],
                     env={**OFFLINE, "TRACKIO_DIR": str(root / "trackio"), **{  # nothing written outside the test's folder
                         f"WANDB_{kind}_DIR": str(root / "wandb-home" / kind.lower()) for kind in ("CACHE", "DATA", "CONFIG")}})
    assert result.returncode == 0, result.stderr[-3000:]
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return out, root / "trackio", read_metrics(out), samples


def samples_at(samples: list[dict], step: int) -> list[dict]:
    return [{k: s[k] for k in trackers.SAMPLE_COLUMNS} for s in samples if s["step"] == step]


# ----------------------------------------------------------------------------- wandb


def wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb transaction log (LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte
    header: CRC, length, type FULL/FIRST/MIDDLE/LAST), after the file's own 7-byte header. wandb 0.31 ships no
    reader of its own."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    block, offset, records, pending = 32768, 7, [], b""
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:  # block trailer
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            offset += room
            continue
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    return records


def read_wandb_run(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """(history rows by step, config) from an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict] = {}
    config: dict = {}
    (log,) = run_dir.glob("run-*.wandb")
    for raw in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(row["_step"]), {}).update(row)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


@pytest.mark.slow
def test_wandb_offline_run_holds_every_metric_the_config_and_sample_tables(tracked_run):
    out, _, rows, samples = tracked_run
    (run_dir,) = (out / "trackers" / "wandb").glob("offline-run-*")
    history, config = read_wandb_run(run_dir)
    assert sorted(history) == [1, 2, 3, 4]
    for row in rows:
        logged = history[row["step"]]
        for key in ("reward", "loss", "completions/mean_length", "rewards/math_accuracy/mean"):
            assert logged[key] == row[key], (row["step"], key)
    assert config["loss.type"] == "grpo" and config["train.max_steps"] == STEPS
    for step in SAMPLED_STEPS:
        table = {k.removeprefix(trackers.SAMPLE_TABLE + "/"): v for k, v in history[step].items()
                 if k.startswith(trackers.SAMPLE_TABLE + "/")}  # a table is logged as a nested value
        assert table["_type"] == "table-file" and table["nrows"] == 4
        content = json.loads((run_dir / "files" / table["path"]).read_text())
        assert content["columns"] == trackers.SAMPLE_COLUMNS
        assert [dict(zip(content["columns"], r)) for r in content["data"]] == samples_at(samples, step)
    assert not any(key.startswith(trackers.SAMPLE_TABLE + "/") for key in history[1])


# ----------------------------------------------------------------------------- trackio


@pytest.mark.slow
def test_trackio_database_holds_every_metric_the_config_and_sample_tables(tracked_run):
    out, trackio_dir, rows, samples = tracked_run
    with sqlite3.connect(trackio_dir / f"{PROJECT}.db") as db:
        (run_name,) = {name for (name,) in db.execute("SELECT run_name FROM metrics")}
        logged = [(step, json.loads(metrics)) for step, metrics in db.execute("SELECT step, metrics FROM metrics ORDER BY id")]
        (config,) = [json.loads(c) for (c,) in db.execute("SELECT config FROM configs")]
    assert run_name == out.name
    scalars = {step: m for step, m in logged if "reward" in m}
    assert sorted(scalars) == [1, 2, 3, 4]
    for row in rows:
        assert scalars[row["step"]]["reward"] == row["reward"] and scalars[row["step"]]["loss"] == row["loss"]
    assert config["loss.type"] == "grpo" and config["train.max_steps"] == STEPS
    tables = {step: m[trackers.SAMPLE_TABLE] for step, m in logged if trackers.SAMPLE_TABLE in m}
    assert sorted(tables) == SAMPLED_STEPS
    for step in SAMPLED_STEPS:
        assert tables[step]["_type"] == "trackio.table"
        assert tables[step]["_value"] == samples_at(samples, step)


# ----------------------------------------------------------------------------- mlflow


@pytest.mark.slow
def test_mlflow_file_store_holds_every_metric_the_config_and_sample_tables(tracked_run):
    out, _, rows, samples = tracked_run
    store = out / "trackers" / "mlruns"
    (run_dir,) = [p.parent for p in store.glob("*/*/meta.yaml") if (p.parent / "metrics").is_dir()]
    assert (run_dir / "tags" / "mlflow.runName").read_text() == out.name
    experiment = (run_dir.parent / "meta.yaml").read_text()
    assert f"name: {PROJECT}" in experiment
    for key in ("reward", "loss"):
        lines = (run_dir / "metrics" / key).read_text().split("\n")
        logged = {int(step): float(value) for _time, value, step in (line.split() for line in lines if line)}
        assert logged == {row["step"]: row[key] for row in rows}, key
    assert (run_dir / "metrics" / "rewards" / "math_accuracy" / "mean").is_file()  # metric names keep their slashes
    assert (run_dir / "params" / "loss.type").read_text() == "grpo"
    for step in SAMPLED_STEPS:
        table = json.loads((run_dir / "artifacts" / trackers.SAMPLE_TABLE / f"step_{step:06d}.json").read_text())
        assert [dict(zip(table["columns"], r)) for r in table["data"]] == samples_at(samples, step)


# ----------------------------------------------------------------------------- installing


def test_a_missing_tracker_package_stops_at_load_saying_what_to_install(monkeypatch, capsys):
    import importlib.util

    from grpo_trainer.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real_find_spec(name, *a))
    code = main(["validate", "configs/demo_cpu.yaml", "logging.report_to=[jsonl, tensorboard, trackio]"])
    assert code == 2
    assert capsys.readouterr().err == (
        "error: logging.report_to: trackio needs the trackio package, which is not installed: "
        "pip install 'grpo-trainer[trackio]'\n")


def test_every_tracker_has_the_extra_its_message_names_and_dev_installs_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow-skinny"}
    for name, tracker in trackers.TRACKERS.items():
        (requirement,) = extras[tracker.extra]
        assert requirement.startswith(installs[name] + ">="), requirement
        assert requirement in extras["dev"], f"the tests run {name}: the dev extra must install it"
