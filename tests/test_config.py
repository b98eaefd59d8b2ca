"""Config loading: YAML onto the schema, dotted overrides, and every error path naming the key."""

from __future__ import annotations

import pytest

from grpo_trainer.config import Config, load_config
from grpo_trainer.errors import ConfigError

from helpers import ROOT, run_cli


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_demo_config_loads_and_defaults_fill_in():
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml")
    assert cfg.model.name_or_path == "builtin:tiny"
    assert cfg.rewards[0].name == "math_accuracy"
    assert cfg.loss.options.epsilon_high_value == cfg.loss.options.epsilon_low  # None means symmetric
    assert cfg.checkpoint.resume == "never"


def test_overrides_are_parsed_as_yaml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, "train: {max_steps: 10}\n"),
        ["train.max_steps=50", "loss.type=dr_grpo", "loss.beta=0.04", "logging.report_to=[jsonl]", "data.shuffle=false"],
    )
    assert cfg.train.max_steps == 50 and cfg.loss.type == "dr_grpo" and cfg.loss.beta == 0.04
    assert cfg.data.shuffle is False and cfg.logging.report_to == ["jsonl"]


def test_override_list_item_by_index(tmp_path):
    path = write(tmp_path, "rewards:\n  - name: math_accuracy\n  - name: think_format\n")
    cfg = load_config(path, ["rewards.1.weight=0.5", "rewards.0.kwargs.timeout=3"])
    assert cfg.rewards[1].weight == 0.5 and cfg.rewards[0].kwargs == {"timeout": 3}


def test_override_item_of_default_reward_list():
    cfg = load_config(None, ["rewards.0.weight=2"])
    assert cfg.rewards[0].name == "math_accuracy" and cfg.rewards[0].weight == 2


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trian.max_steps=3", "trian: unknown key; did you mean 'train'"),
        ("train.max_step=3", "train.max_step: unknown key; did you mean 'train.max_steps'"),
        ("loss.epsilon_hi=0.3", "did you mean 'loss.options.epsilon_high'"),
        ("rewards.0.wieght=2", "did you mean 'rewards.0.weight'"),
    ],
)
def test_unknown_keys_name_the_path_and_suggest(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"loss.zzz: unknown key; valid keys here: type, options, beta"):
        load_config(None, ["loss.zzz=1"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_steps=abc", "train.max_steps"),
        ("train.max_steps=0", "train.max_steps: Input should be greater than 0"),
        ("loss.type=ppo", "loss.type: unknown loss_type 'ppo'; expected one of ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'gspo', 'cispo', 'sapo', 'luspo', 'vespo')"),
        ("rollout.num_generations=1", "rollout.num_generations"),
        ("loss.scale_rewards=std", "loss.scale_rewards"),
    ],
)
def test_wrong_types_and_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.micro_batch_size=5"], "train.micro_batch_size (5) must divide the completions per step"),
        (["train.micro_batch_size=1024"], "larger than the completions per step"),
        (["loss.delta=1.1"], "loss: options: delta (1.1) must be larger than 1 + epsilon_high"),
        (["rollout.vllm_server.weight_sync=nfs"], "rollout.vllm_server.weight_sync: Input should be 'nccl', 'gloo', 'disk' or 'none'"),
        (["rollout.vllm_server.base_url=http://a:1", "rollout.vllm_server.urls=[http://b:1]"],
         "rollout.vllm_server: give either base_url (one server) or urls (several), not both"),
        (["rollout.vllm_server.urls=[b:1]"], "rollout.vllm_server.urls: 'b:1' is not an http:// or https:// address"),
        (["rollout.vllm.base_url=http://x"], "rollout.vllm.base_url: moved to 'rollout.vllm_server.base_url'"),
        (["rewards=[]"], "rewards: at least one reward is needed"),
    ],
)
def test_impossible_combinations_fail_at_load(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_missing_required_reward_name(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards.0.name: Field required"):
        load_config(write(tmp_path, "rewards:\n  - weight: 1\n"))


def test_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="no list item 3"):
        load_config(None, ["rewards.3.weight=1"])


def test_resolved_config_round_trips():
    cfg = load_config(None, ["loss.type=dapo", "loss.epsilon_high=0.28"])
    import yaml

    again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.slow
def test_validate_command_prints_resolved_config_or_fails_clearly():
    ok = run_cli(["validate", "configs/demo_cpu.yaml", "train.max_steps=7"])
    assert ok.returncode == 0, ok.stderr
    assert "max_steps: 7" in ok.stdout and "epsilon_low: 0.2" in ok.stdout
    bad = run_cli(["validate", "configs/demo_cpu.yaml", "train.max_stesp=7"])
    assert bad.returncode == 2
    assert "did you mean 'train.max_steps'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["checkpoint.resume=/no/such/folder"], "error: checkpoint.resume: /no/such/folder does not exist"),
        (["checkpoint.resume=configs"], "error: checkpoint.resume: configs is not a complete checkpoint"),
        (["rollout.engine=vllm_colocate"], "error: rollout.engine: vLLM's CPU build cannot run 'builtin:tiny' (attention head size 24"),
    ],
)
@pytest.mark.slow
def test_validate_refuses_what_cannot_run_here_in_one_line(overrides, expected, tiny_model_path):
    result = run_cli(["validate", "configs/demo_cpu.yaml", *overrides])
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.slow
def test_warmup_longer_than_the_run_is_a_warning_and_a_smoke_test_trains(tmp_path, tiny_model_path):
    """The first thing a user tries: the demo with train.max_steps=2 (its warmup is 3 steps)."""
    validated = run_cli(["validate", "configs/demo_cpu.yaml", "train.max_steps=2"])
    assert validated.returncode == 0
    assert "warning: train.warmup_steps (3) is not below the run's 2 optimizer steps" in validated.stderr
    trained = run_cli(["train", "configs/demo_cpu.yaml", "train.max_steps=2", f"output_dir={tmp_path / 'run'}",
                       "logging.progress_bar=false"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "train.warmup_steps (3) is not below" in trained.stderr
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_bfloat16_on_a_cpu_without_bf16_instructions_is_a_warning(monkeypatch):
    from grpo_trainer import preflight as pf
    from grpo_trainer.config import load_config

    assert not pf.cpu_has_bf16_instructions("processor : 0\nflags : fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
    assert pf.cpu_has_bf16_instructions("flags : fpu avx512f avx512_bf16\n")
    assert pf.cpu_has_bf16_instructions("Features : fp asimd bf16 i8mm\n")  # Arm
    assert pf.cpu_has_bf16_instructions("")  # nothing readable: no false alarm
    monkeypatch.setattr(pf, "_runs_on_cpu", lambda: True)
    for native, expected in ((False, 1), (True, 0)):
        monkeypatch.setattr(pf, "cpu_has_bf16_instructions", lambda native=native: native)
        bf16 = [w for w in pf.preflight(load_config("configs/demo_cpu.yaml", ["model.dtype=bfloat16"])) if "bfloat16" in w]
        assert len(bf16) == expected and all(w.startswith("model.dtype: bfloat16 on a CPU without") for w in bf16)
    monkeypatch.setattr(pf, "cpu_has_bf16_instructions", lambda: False)
    assert not [w for w in pf.preflight(load_config("configs/demo_cpu.yaml")) if "bfloat16" in w]  # float32: quiet


def test_min_p_with_top_p_or_top_k_is_refused_naming_the_keys():
    from grpo_trainer.config import load_config
    from grpo_trainer.errors import ConfigError

    assert load_config("configs/demo_cpu.yaml", ["rollout.min_p=0.1"]).rollout.min_p == 0.1
    for other in ("rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match="rollout.min_p cannot be combined with rollout.top_p or rollout.top_k"):
            load_config("configs/demo_cpu.yaml", ["rollout.min_p=0.1", other])


def test_stop_strings_load_and_an_empty_one_is_refused():
    from grpo_trainer.config import load_config
    from grpo_trainer.errors import ConfigError

    stop = load_config("configs/demo_cpu.yaml", [r'rollout.stop=["</answer>", "\n\n"]']).rollout.stop
    assert stop == ["</answer>", "\n\n"]  # YAML's escapes: two newlines
    with pytest.raises(ConfigError, match="rollout.stop: an empty stop string"):
        load_config("configs/demo_cpu.yaml", ['rollout.stop=["a", ""]'])


def test_the_tool_keys_of_rollout_load_into_environment_with_one_deprecation_line(caplog, monkeypatch):
    from grpo_trainer.config import migrate

    monkeypatch.setattr(migrate, "_told", set())
    old = ["rollout.tools=[python]", "rollout.max_tool_turns=2", "rollout.tool_timeout=3", "rollout.tool_output_chars=1000"]
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        cfg = load_config(None, old)
        again = load_config(None, old)
    new = load_config(None, [key.replace("rollout.", "environment.") for key in old])
    assert cfg == again == new and cfg.environment.tools == ["python"] and cfg.environment.tool_timeout == 3
    lines = [r.getMessage() for r in caplog.records]
    # once per key and process; tool_output_chars is at its default (a resolved config of an earlier version)
    assert lines == [f"config key rollout.{key} is deprecated: it is now environment.{key} (read as environment.{key} "
                     "this time)" for key in ("tools", "max_tool_turns", "tool_timeout")]
    with pytest.raises(ConfigError, match=r"  rollout.tools: moved to environment.tools, which is set too: set only "
                                          r"environment.tools$"):
        load_config(None, ["rollout.tools=[python]", "environment.tools=[python]"])
    with pytest.raises(ConfigError, match=r"  rollout.tool_timeout \(now environment.tool_timeout\): Input should be "
                                          r"greater than 0 \(got -1\)$"):
        load_config(None, ["rollout.tool_timeout=-1"])


def test_a_saved_config_of_an_earlier_version_loads_as_today_s():
    """A checkpoint's resolved config lists every key at its place then: it loads and compares as today's."""
    from grpo_trainer.config import config_from_dict

    today = load_config("configs/tools_cpu.yaml").model_dump(mode="json")
    tools = ("tools", "max_tool_turns", "tool_timeout", "tool_output_chars")
    earlier = {**today, "environment": {k: v for k, v in today["environment"].items() if k not in tools},
               "rollout": {**today["rollout"], **{k: today["environment"][k] for k in tools}},
               "loss": {**{k: v for k, v in today["loss"].items() if k != "options"}, **today["loss"]["options"],
                        "sapo_temperature_pos": 1.0}}
    assert config_from_dict(earlier).model_dump(mode="json") == today
