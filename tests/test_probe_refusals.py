"""Issue 43 part 4's probe defects on config, validate, kernels and serve: each refusal in one line, naming the key,
file, class or URL, before any model loads where it can."""

from __future__ import annotations

import pytest

from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("environment.reward_weight=.nan", "environment.reward_weight", "nan"),
        ("rewards.0.weight=.nan", "rewards.0.weight", "nan"),
        ("loss.teacher_kl=.inf", "loss.teacher_kl", "inf"),
        ("train.learning_rate=-.inf", "train.learning_rate", "-inf"),
        ("loss.epsilon_high=.nan", "loss: epsilon_high (options.epsilon_high of type grpo)", "nan"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(override, key, value):
    """Defect 12: a NaN weight scored every step NaN (nothing trained, exit 0); an infinite teacher_kl skipped
    every step."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{key}: Input should be a finite number (got {value})" in str(err.value)


def test_a_finite_reward_too_large_for_float32_arithmetic_stops_naming_the_reward():
    """Defect 12: an environment reward of 1e300 passed the finite check, and the step was skipped as NaN."""
    from types import SimpleNamespace

    from grpo_trainer.environments.scoring import environment_reward
    from grpo_trainer.errors import RewardError
    from grpo_trainer.rewards import compute_rewards

    episodes = [SimpleNamespace(env_reward=r) for r in (1.0, 1e300, 0.0)]
    with pytest.raises(RewardError, match=r"reward 'environment' returned 1e\+300 for sample 1 .*beyond float32's range"):
        compute_rewards([environment_reward(1.0)], ["p"] * 3, ["c"] * 3, [[1]] * 3, {"episodes": episodes})
    fine = compute_rewards([environment_reward(1.0)], ["p"] * 3, ["c"] * 3, [[1]] * 3,
                           {"episodes": [SimpleNamespace(env_reward=r) for r in (1.0, 1e6, 0.0)]})
    assert fine.total.tolist() == [1.0, 1e6, 0.0]


def test_pure_distillation_needs_no_reward_and_the_refusal_says_so():
    """Defect 21: `teacher_only` with `rewards: []` was refused with a message that never named the teacher, though
    docs/distillation.md says pure distillation needs no reward (a 2-step CLI run of it trains: teacher/reverse_kl)."""
    cfg = load_config(None, ["teacher={name_or_path: builtin:tiny}", "loss.teacher_kl=1", "loss.teacher_only=true",
                             "rewards=[]"])
    assert cfg.rewards == [] and cfg.loss.teacher_only
    with pytest.raises(ConfigError, match=r"rewards: at least one reward is needed \(.*or loss.teacher_only with a teacher"):
        load_config(None, ["teacher={name_or_path: builtin:tiny}", "loss.teacher_kl=1", "rewards=[]"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        ([], "the model has no LoRA adapters (model.lora is not set)"),
        (["rollout.engine=vllm_server", "model.lora={r: 8}"], "rollout.vllm_server.weights_dir is not set"),
        (["rollout.engine=vllm_colocate", "model.lora={r: 1024}"], "model.lora.r=1024 is above vLLM's largest"),
    ],
)
def test_lora_sync_adapter_is_refused_at_load_for_what_the_config_alone_tells(overrides, says):
    """Defect 16: without model.lora, `adapter` was silently ignored on the hf engine; on vllm_server the refusals
    that depend only on the config came after `train` had waited 60 s for a server, and never from validate."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.lora_sync=adapter", *overrides])
    assert f"rollout.lora_sync=adapter: {says}" in str(err.value)


@pytest.mark.slow
def test_serve_dry_run_refuses_adapter_without_weights_dir_and_an_empty_host():
    """Defects 16 and 23: `serve --dry-run` printed a command for an adapter set-up the trainer refuses, and
    `--host ''` silently became 127.0.0.1."""
    from helpers import run_cli

    server = ["rollout.engine=vllm_server", "model.lora={r: 8}"]
    refused = run_cli(["serve", "configs/demo_cpu.yaml", *server, "rollout.lora_sync=adapter", "--dry-run"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "rollout.lora_sync=adapter: rollout.vllm_server.weights_dir is not set" in refused.stderr
    empty = run_cli(["serve", "configs/demo_cpu.yaml", *server, "--dry-run", "--host", ""])
    assert empty.returncode == 2 and empty.stdout == ""
    assert "argument --host: '' is not a host name or address" in empty.stderr
    ok = run_cli(["serve", "configs/demo_cpu.yaml", *server, "--dry-run", "--host", "10.0.0.5"])
    assert ok.returncode == 0 and "--host 10.0.0.5 " in ok.stdout


@pytest.mark.parametrize(
    "url, says",
    [
        ("openenv+ws://127.0.0.1:0", "the port must be a number from 1 to 65535"),
        ("openenv+ws://127.0.0.1:99999", "the port must be a number from 1 to 65535"),
        ("openenv+ws://[::1", "expected openenv+ws://HOST:PORT"),
        ("openenv+ws://[1::2::3]:80", "[1::2::3] is not an IPv6 address"),
    ],
)
def test_environment_url_port_range_and_ipv6(url, says):
    """Defect 17: ports 0 and 99999 passed validate (refused for rollout.vllm_server.urls and serve --port), and an
    IPv6 address was refused."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"environment.url={url}"])
    assert f"environment.url: {says}" in str(err.value)
    assert load_config(None, ["environment.url=openenv+ws://[::1]:8001"]).environment.url == "openenv+ws://[::1]:8001"


def _http_server(host: str, family, answers: dict[str, bytes]):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = answers.get(self.path, b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = family

    server = Server((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_schema_that_is_not_json_is_named_as_such_and_ipv6_servers_are_reached():
    """Defect 17: a /schema that is not JSON was reported as "no OpenEnv server answers"."""
    import socket

    from grpo_trainer.environments.openenv_ws import fetch_schema

    server = _http_server("127.0.0.1", socket.AF_INET, {"/schema": b"<html>a web page</html>"})
    url = f"openenv+ws://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(ConfigError) as err:
        fetch_schema(url, timeout=5)
    server.shutdown()
    assert str(err.value) == (f"environment.url {url}: GET http://127.0.0.1:{server.server_address[1]}/schema "
                              "answered, but not with JSON ('<html>a web page</html>'); is it an OpenEnv server?")
    if not socket.has_ipv6:
        return
    try:
        server = _http_server("::1", socket.AF_INET6, {"/schema": b'{"action": {}, "observation": {}}'})
    except OSError:  # no IPv6 loopback on this machine
        return
    url = f"openenv+ws://[::1]:{server.server_address[1]}"
    assert fetch_schema(load_config(None, [f"environment.url={url}"]).environment.url, timeout=5) == {
        "action": {}, "observation": {}}
    server.shutdown()


@pytest.mark.parametrize(
    "targets, says",
    [
        ("[nonexistent_proj]", "model.lora.target_modules: 'nonexistent_proj' is not a module of builtin:tiny; "
                               "builtin:tiny's linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"),
        ("[norm]", "model.lora.target_modules: Target module LlamaRMSNorm"),
    ],
)
def test_lora_targets_the_model_lacks_are_one_line_naming_its_layers(targets, says, tiny_model_path):
    """Defect 14: PEFT tracebacks."""
    from grpo_trainer.models import load_causal_lm

    cfg = load_config(None, [f"model.lora={{target_modules: {targets}}}"])
    with pytest.raises(ConfigError) as err:
        load_causal_lm(cfg.model)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_lora_targets_empty_is_refused_and_a_string_is_one_module_name(tiny_model_path):
    """Defect 14: `[]` passed validate (then a PEFT traceback); `q_proj` as a string was read by PEFT as a regular
    expression over whole dotted paths, matching nothing."""
    from grpo_trainer.models import load_causal_lm

    with pytest.raises(ConfigError, match=r"model.lora.target_modules: empty: name the modules to adapt"):
        load_config(None, ["model.lora={target_modules: []}"])
    cfg = load_config(None, ["model.lora={target_modules: q_proj}"])
    assert cfg.model.lora.target_modules == ["q_proj"]
    adapted = [name for name, _ in load_causal_lm(cfg.model).named_modules() if name.endswith(".lora_A")]
    assert adapted and all(name.endswith("self_attn.q_proj.lora_A") for name in adapted)
    assert load_config(None, ["model.lora={r: 8}"]).model.lora.target_modules == "all-linear"


def test_empty_model_names_are_refused_at_load():
    """Defect 13: `teacher.name_or_path=""` reached Hugging Face as a repo id, after the policy had loaded."""
    for override in ['teacher.name_or_path=""', 'model.name_or_path=" "', 'model.tokenizer=""']:
        with pytest.raises(ConfigError, match=r"name_or_path|tokenizer"):
            load_config(None, [override, "loss.teacher_kl=1"] if "teacher" in override else [override])


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "train", "kernels"])
def test_missing_model_folders_are_one_line_before_anything_loads(command, tmp_path):
    """Defect 13: a missing teacher folder, or one without a model, was a Hugging Face traceback (`Repo id must be
    in the form ...`) after the policy had loaded; the same for model.name_or_path, and in `kernels`."""
    from helpers import run_cli

    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["teacher={name_or_path: " + str(tmp_path / "nope") + "}", "loss.teacher_kl=1"],
         f"error: teacher.name_or_path: {tmp_path / 'nope'}: no such folder (and not a Hugging Face model id"),
        ([f"model.name_or_path={empty}"], f"error: model.name_or_path: {empty} is a folder without a model (no config.json"),
    ]
    for overrides, says in cases[:1] if command == "kernels" else cases:
        if command == "kernels":
            overrides = [f"model.name_or_path={tmp_path / 'nope'}"]
            says = f"error: model.name_or_path: {tmp_path / 'nope'}: no such folder"
        result = run_cli([command, "configs/demo_cpu.yaml", *overrides, f"output_dir={tmp_path / 'out'}"])
        assert result.returncode == 2, result.stderr[-2000:]
        assert says in result.stderr and "Traceback" not in result.stderr
        assert "Loading weights" not in result.stderr  # nothing loaded first


GUESS = ["configs/guess_cpu.yaml", "train.max_steps=1", "train.prompts_per_step=2", "rollout.num_generations=4",
         "train.micro_batch_size=8", "eval.every=0", "checkpoint.save_every=0"]


def _env_files(tmp_path):
    (tmp_path / "noreset.py").write_text("class Env:\n    def step(self, reply):\n        return 'x', True\n")
    (tmp_path / "broken.py").write_text("class Env(:\n")
    return [
        ([f"environment.factory={tmp_path / 'missing.py'}:Env"],
         f"error: environment.factory: environment file not found: {tmp_path / 'missing.py'}"),
        ([f"environment.factory={tmp_path / 'noreset.py'}:Nope"], "error: environment.factory: "),
        ([f"environment.factory={tmp_path / 'noreset.py'}:Env"], "Env has no reset method; an environment class needs"),
        ([f"environment.factory={tmp_path / 'broken.py'}:Env"], "failed: SyntaxError"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "train", "kernels"])
def test_environment_problems_are_one_line_before_the_model_loads(command, tmp_path):
    """Defect 15: a missing factory file or class, a syntax error, no reset: found after the model loaded; validate
    exited 0 for a factory file that did not exist."""
    from helpers import run_cli

    for overrides, says in _env_files(tmp_path):
        result = run_cli([command, *GUESS, *overrides, f"output_dir={tmp_path / 'out'}"])
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        assert says in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert "Loading weights" not in result.stderr  # before the model loads


@pytest.mark.slow
def test_an_unreachable_environment_server_stops_train_before_the_model_loads_and_kernels_plans_without_it(tmp_path):
    """Defect 15: an unreachable environment.url was found after the model loaded; `kernels` needed the server up."""
    from helpers import free_port, run_cli

    url = f"openenv+ws://127.0.0.1:{free_port()}"
    base = ["configs/demo_cpu.yaml", f"environment.url={url}", "rewards=[]", "train.max_steps=1",
            f"output_dir={tmp_path / 'out'}"]
    train = run_cli(["train", *base])
    assert train.returncode == 2 and f"error: environment.url {url}: no OpenEnv server answers" in train.stderr
    assert "Loading weights" not in train.stderr and "Traceback" not in train.stderr
    assert run_cli(["validate", *base]).returncode == 0  # as for vLLM servers: validate does not contact it
    kernels = run_cli(["kernels", *base])
    assert kernels.returncode == 0, kernels.stderr[-2000:]
    assert "kernels: planned for prompts without the environment's tool schema" in kernels.stderr


@pytest.mark.slow
def test_resume_never_in_a_used_folder_removes_the_earlier_runs_checkpoints(tmp_path):
    """Defect 19: `checkpoint.resume: never` kept the old run's checkpoints interleaved with the new run's (A's
    step-1/3 beside B's step-2), though the message said they "will be overwritten"; a later resume=auto could then
    take the old run's newest."""
    from helpers import run_cli, small_run_overrides

    out = tmp_path / "run"
    first = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=3), "checkpoint.save_every=1"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001", "step-000002", "step-000003"]
    second = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=2), "checkpoint.save_every=2",
                      "seed=5"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "removing the earlier run's 3 checkpoint(s) (step-000001, step-000002, step-000003)" in second.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000002"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert '"seed": 5' in (out / "checkpoints" / "step-000002" / "trainer_state.json").read_text()


@pytest.mark.slow
def test_user_code_that_changes_folder_does_not_split_the_run(tmp_path):
    """Defect 4: an environment (here a reward) that calls os.chdir split the run: config.yaml and metrics.jsonl in
    ./rel_out, checkpoints and the model under the new folder; a later resume=auto found nothing. Every local path
    is made absolute once, at the start (output_dir and the reward file given relative to the working folder)."""
    import os

    from helpers import ROOT, run_cli, small_run_overrides

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reward = tmp_path / "wander.py"
    reward.write_text("import os\n"
                      "def wander(completions, **kw):\n"
                      f"    os.chdir({str(elsewhere)!r})\n"
                      "    return [1.0 if i % 2 else 0.0 for i in range(len(completions))]\n")
    out = os.path.relpath(tmp_path / "rel_out", ROOT)  # run_cli runs from the repository's root
    spec = os.path.relpath(reward, ROOT) + ":wander"
    overrides = [*small_run_overrides(out, steps=2), f"rewards=[{{name: '{spec}'}}]", "checkpoint.save_every=1"]
    first = run_cli(["train", "configs/demo_cpu.yaml", *overrides])
    assert first.returncode == 0, first.stderr[-2000:]
    assert list(elsewhere.iterdir()) == []  # nothing written where the reward went
    run = tmp_path / "rel_out"
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file() and (run / "model").is_dir()
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    again = run_cli(["train", "configs/demo_cpu.yaml", *overrides, "train.max_steps=3", "checkpoint.resume=auto"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr and "step-000002 at step 2" in again.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == "step-000003"


@pytest.mark.slow
def test_lora_targets_the_model_lacks_are_refused_by_validate(tiny_model_path):
    """Defect 14, before the model loads: checked on a weightless skeleton of the model (its config.json)."""
    from helpers import run_cli

    result = run_cli(["validate", "configs/demo_cpu.yaml", "model.lora={target_modules: [nonexistent_proj]}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: model.lora.target_modules: 'nonexistent_proj' is not a module of builtin:tiny" in result.stderr
    assert run_cli(["validate", "configs/demo_cpu.yaml", "model.lora={target_modules: [q_proj]}"]).returncode == 0
