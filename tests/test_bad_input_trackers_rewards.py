"""Bad input that used to surface only after the model loaded, or never (issue 35, section 3): a tracker that cannot
start (wandb online without an API key, an MLflow tracking server nobody runs), checked by preflight, which `train`
runs before anything loads or is written (shown for a server address in test_bad_input_servers.py); a reward that
scores nothing, step after step."""

from __future__ import annotations

import math
import socket
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer import trackers
from grpo_trainer.checkpoint import read_trainer_state
from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError, TrainingError
from grpo_trainer.metrics import read_metrics
from grpo_trainer.preflight import preflight
from grpo_trainer.rewards import Reward
from grpo_trainer.samples import EpisodeStats
from grpo_trainer.update import ScoreChecks, check_scored
from helpers import free_port, run_cli, small_run_overrides

WANDB = ["logging.report_to=[jsonl, wandb]"]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the network was touched: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def bare_wandb(monkeypatch, tmp_path):
    """A machine where wandb has never been logged in to: no key in the environment, no settings, no .netrc."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings either
    return tmp_path


def test_wandb_online_without_an_api_key_is_refused_before_the_model_loads_without_the_network(bare_wandb, no_network,
                                                                                                 monkeypatch):
    cfg = load_config(None, WANDB)
    with pytest.raises(ConfigError) as error:
        preflight(cfg)
    message = str(error.value)
    assert message.startswith("logging.report_to: wandb is online and finds no API key: set WANDB_API_KEY")
    assert "WANDB_MODE=offline" in message and "\n" not in message
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "x" * 40)):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            preflight(cfg)  # nothing to refuse
    from wandb.sdk.wandb_settings import Settings

    host = Settings().base_url.split("://", 1)[1]
    (bare_wandb / "netrc").write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")  # what `wandb login` writes
    preflight(cfg)


def test_an_mlflow_tracking_server_nobody_runs_is_refused_naming_the_uri(monkeypatch):
    cfg = load_config(None, ["logging.report_to=[jsonl, mlflow]"])
    uri = f"http://127.0.0.1:{free_port()}"  # a loopback port nobody listens on
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ConfigError) as error:
        preflight(cfg)
    assert str(error.value) == (f"logging.report_to: mlflow: the tracking server MLFLOW_TRACKING_URI={uri} cannot be reached "
                                "(Connection refused): start it or correct the URI, or unset MLFLOW_TRACKING_URI to log to "
                                "OUTPUT_DIR/trackers/mlruns")
    with socket.socket() as listening:  # something accepts connections there: up to MLflow to judge the rest
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{listening.getsockname()[1]}")
        preflight(cfg)
    for local in ("file:///tmp/mlruns", "sqlite:///mlflow.db", ""):  # not a server: nothing to reach
        monkeypatch.setenv("MLFLOW_TRACKING_URI", local)
        assert trackers.unreachable(local) is None


# ----------------------------------------------------------------------------- rewards that score nothing


def score_checks(limit: int, names=("accuracy", "format")) -> ScoreChecks:
    cfg = load_config(None, [f"train.max_consecutive_unscored={limit}"])
    return ScoreChecks.of(cfg, [Reward(n, lambda **kw: []) for n in names])


def scores(*columns):
    return torch.tensor(columns, dtype=torch.float32).T  # per_function [N, R]


NAN = math.nan
NO_EPISODES = EpisodeStats()  # no tools, no environment


def test_steps_no_reward_scored_are_warned_about_and_stop_the_run_after_the_limit(caplog):
    checks = score_checks(limit=2)
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        count = check_scored(scores([NAN] * 4, [NAN] * 4), NO_EPISODES, step=1, unscored_in_a_row=0, checks=checks)
        count = check_scored(scores([NAN] * 4, [NAN] * 4), NO_EPISODES, step=2, unscored_in_a_row=count, checks=checks)
        assert count == 2
        with pytest.raises(TrainingError) as error:
            check_scored(scores([NAN] * 4, [NAN] * 4), NO_EPISODES, step=3, unscored_in_a_row=count, checks=checks)
    for step, count in ((1, 1), (2, 2)):
        assert (f"step {step}: no reward scored any completion (reward 'accuracy', 'format' returned None or NaN for all 4): "
                f"nothing to learn from this step ({count} in a row; train.max_consecutive_unscored=2)") in caplog.text
    assert str(error.value).startswith("step 3: 3 steps in a row in which no reward scored any completion (reward "
                                       "'accuracy', 'format' returned None or NaN for all 4); stopping "
                                       "(train.max_consecutive_unscored=2)")


def test_a_scored_step_resets_the_count_and_a_reward_silent_on_its_own_is_named(caplog):
    checks = score_checks(limit=1)
    count = check_scored(scores([NAN] * 4, [NAN] * 4), NO_EPISODES, step=1, unscored_in_a_row=0, checks=checks)
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        # one completion scored: something to learn
        count = check_scored(scores([NAN, NAN, 1.0, NAN], [NAN] * 4), NO_EPISODES, step=2, unscored_in_a_row=count, checks=checks)
        assert count == 0
        count = check_scored(scores([0.0, 1.0, 1.0, 0.0], [NAN] * 4), NO_EPISODES, step=3, unscored_in_a_row=count, checks=checks)
    assert "step 3: reward 'format' returned None or NaN for all 4 completions (the others scored them)" in caplog.text
    assert "reward 'accuracy' returned" not in caplog.text
    count = check_scored(scores([NAN] * 4, [NAN] * 4), NO_EPISODES, step=4, unscored_in_a_row=count, checks=checks)
    assert count == 1  # 1 in a row again: within the limit


@pytest.mark.slow
def test_a_reward_that_scores_nothing_stops_the_run_and_the_count_survives_a_resume(tmp_path):
    reward = tmp_path / "silent.py"
    reward.write_text("def silent(completions, **kwargs):\n    return [float('nan')] * len(completions)\n")
    out = tmp_path / "run"
    args = ["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=1), "rollout.max_completion_length=4",
            f"rewards=[{{name: '{reward}:silent'}}]", "train.max_consecutive_unscored=1"]
    first = run_cli(args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 1: no reward scored any completion (reward 'silent' returned None or NaN for all 16)" in first.stderr
    assert read_trainer_state(out / "checkpoints" / "step-000001")["unscored_in_a_row"] == 1
    resumed = run_cli([*args, "train.max_steps=2", "checkpoint.resume=auto"])  # the second in a row is one too many
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert ("error: step 2: 2 steps in a row in which no reward scored any completion (reward 'silent' returned None or "
            "NaN for all 16); stopping (train.max_consecutive_unscored=1)") in resumed.stderr
    assert "Traceback" not in resumed.stderr and [r["step"] for r in read_metrics(out)] == [1]
