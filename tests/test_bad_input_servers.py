"""Bad input around the vLLM server engine, tried as a new user would (issue 35, section 3), without vLLM: `serve`'s
flags, server URLs, addresses that answer but are not vLLM, the disk push's folder, and the tools wrapper's
forwarding. Servers here are small HTTP servers in a thread of the test (`Answering`); the real vLLM server, killed
under a tools run, is in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo_trainer import cli
from grpo_trainer.config import ModelConfig, VLLMServerConfig, load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.rollout import Rollout, SamplingSettings
from grpo_trainer.rollout import Reconnects, ServerGone, Sleeps, capability, needs_weight_sync
from grpo_trainer.rollout.vllm_server import NotAVLLMServer, VLLMServerEngine
from grpo_trainer.serve import serve_command, shell_line
from helpers import ROOT, free_port, run_cli, small_run_overrides

SAMPLING = SamplingSettings(eos_token_ids=[2], max_completion_length=8)
CONFIG = str(ROOT / "configs" / "demo_cpu.yaml")


class Answering:
    """An HTTP server on 127.0.0.1 (in a thread) answering every request with `answer(method, path, body)` ->
    (status, content type, bytes)."""

    def __init__(self, answer):
        class Handler(BaseHTTPRequestHandler):
            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, kind, data = answer(self.command, self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def answering():
    servers = []

    def start(answer):
        servers.append(Answering(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def as_json(value, status=200):
    return status, "application/json", json.dumps(value).encode()


HTML = (200, "text/html", b"<!doctype html>\n<html><head><title>Jupyter Server</title></head><body>...</body></html>")


class FakeVLLM:
    """What the vllm_server engine asks of a server with weight_sync `disk`, answered as vLLM 0.32 does (processed
    log-probs: the runner-up's gap halves from T = 1 to T = 2); it records the folders it is told to load."""

    def __init__(self):
        self.version = "default"
        self.loaded: list[Path] = []  # weights files it read, one per push

    def __call__(self, method, path, body):
        route = path.split("?")[0]
        if route == "/health":
            return 200, "application/json", b""
        if route == "/v1/models":
            return as_json({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "vllm",
                                                        "root": "fake-model", "parent": None, "max_model_len": 64}]})
        if route == "/is_paused":
            return as_json({"is_paused": False})
        if route == "/v1/completions":
            gap = 2.0 / body["temperature"]
            return as_json({"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"a": -0.1, "b": -0.1 - gap}]}}]})
        if route == "/collective_rpc":
            weights = Path(body["kwargs"]["weights_path"]) / "model.safetensors"
            assert weights.is_file(), weights  # the server reads it
            self.loaded.append(weights)
            return as_json({"results": [True]})  # one worker; grpo_reload_weights returns True
        if route == "/update_weight_version":
            self.version = body["new_version"]
            return as_json({"success": True, "new_version": self.version})
        if route == "/weight_info":
            return as_json({"weight_version": self.version})
        if route == "/pause":
            return as_json({"status": "paused"})
        if route == "/resume":
            return as_json({"status": "resumed"})
        if route == "/reset_prefix_cache":
            return as_json({"success": True})
        return as_json({"detail": "Not Found"}, 404)  # FastAPI's answer for a route the server lacks


# ---------------------------------------------------------------------------- serve (item 4)


@pytest.fixture
def cpu_vllm(monkeypatch):
    """vLLM would run on the CPU here (not asked of vLLM itself: importing it takes seconds)."""
    monkeypatch.setattr("grpo_trainer.serve._cpu_only", lambda: True)


@pytest.mark.parametrize("flag, value, says", [
    ("--port", "0", "argument --port: '0' is not a port number (1-65535)"),
    ("--port", "99999", "argument --port: '99999' is not a port number (1-65535)"),
    ("--tensor-parallel-size", "0", "argument --tensor-parallel-size: '0' is not a whole number of at least 1"),
    ("--tensor-parallel-size", "-3", "argument --tensor-parallel-size: '-3' is not a whole number of at least 1"),
])
def test_serve_refuses_a_port_or_tensor_parallel_size_out_of_range_naming_the_option(flag, value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", CONFIG, "rollout.engine=vllm_server", "--dry-run", f"{flag}={value}"])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode after -- would override --logprobs-mode processed_logprobs, "
                                          "which the vllm_server engine needs; leave it out"),
    (["--logprobs_mode=raw_logprobs"], "would override --logprobs-mode processed_logprobs"),
    (["--dtype", "bfloat16"], "would override --dtype float32, which serve sets from the config: set rollout.vllm.dtype"),
    (["--seed", "5"], "set seed instead"),
    (["-tp", "2"], "set serve's --tensor-parallel-size"),
    (["--port", "9000"], "set serve's --port instead"),
    (["--no-enforce-eager"], "would override --enforce-eager, which serve sets from the config: set rollout.vllm.enforce_eager"),
    (["--weight-transfer-config", '{"backend": "nccl"}'], "set rollout.vllm_server.weight_sync instead"),
    (["--no-enable-scale-out"], "would override --enable-scale-out, which the vllm_server engine needs; leave it out"),
    (["--enable_scale_out=false"], "would override --enable-scale-out, which the vllm_server engine needs"),
])
def test_serve_refuses_vllm_arguments_that_would_override_its_own_flags(extra, says, tiny_model_path, cpu_vllm):
    cfg = load_config(CONFIG, ["rollout.engine=vllm_server"])
    with pytest.raises(ConfigError, match="^serve: " + extra[0]) as error:
        serve_command(cfg, vllm_args=extra)
    assert says in str(error.value) and "\n" not in str(error.value)
    others = ["--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"]  # flags serve leaves to vLLM pass through
    assert shell_line(*serve_command(cfg, vllm_args=others)).endswith(" ".join(others))


def test_serve_dry_run_prints_the_command_where_vllm_is_not_installed(monkeypatch, capsys, tiny_model_path):
    for name in ("vllm", "vllm.platforms"):
        monkeypatch.setitem(sys.modules, name, None)  # `import vllm` fails, as on a machine without it
    args = ["serve", CONFIG, "rollout.engine=vllm_server", "rollout.vllm_server.base_url=http://10.0.0.7:8123"]
    assert cli.main([*args, "--dry-run", "--port", "8200", "--tensor-parallel-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert "--host 0.0.0.0 --port 8200" in out and "--tensor-parallel-size 2" in out
    assert "--logprobs-mode processed_logprobs --enable-scale-out" in out and "--kv-cache-memory-bytes" not in out
    assert "vLLM is not installed here" in err and "--kv-cache-memory-bytes 1073741824" in err
    assert cli.main(args) == 2  # starting it here cannot work: one line, no traceback
    assert capsys.readouterr().err.strip() == ("error: serve: vLLM is not installed here: pip install 'grpo-trainer[vllm]' "
                                               "(docs/vllm.md), or add --dry-run to print the command for a machine that has it")


def test_serve_listens_where_the_trainer_connects_for_a_url_without_a_port(tiny_model_path, cpu_vllm):
    for url, port in (("http://127.0.0.1", "80"), ("https://10.1.2.3", "443"), ("http://127.0.0.1:8123", "8123")):
        cfg = load_config(CONFIG, ["rollout.engine=vllm_server", f"rollout.vllm_server.base_url={url}"])
        command, _ = serve_command(cfg)
        assert command[command.index("--port") + 1] == port, url


@pytest.mark.parametrize("url, says", [
    ("http://", "names no host"),
    ("http://:8000", "names no host"),
    ("http://127.0.0.1:80a", "the port must be a number from 1 to 65535"),
    ("http://127.0.0.1:99999", "the port must be a number from 1 to 65535"),
    ("http://127.0.0.1:0", "the port must be a number from 1 to 65535"),
    ("127.0.0.1:8000", "is not an http:// or https:// address"),
])
def test_an_address_no_server_can_have_is_refused_when_the_config_loads(url, says):
    for key, value in (("base_url", url), ("urls", f"[http://127.0.0.1:8001, '{url}']")):
        with pytest.raises(ConfigError, match=f"rollout.vllm_server.{key}: '{url}'.*{says}"):
            load_config(None, [f"rollout.vllm_server.{key}={value}"])


# ---------------------------------------------------------------------------- not a vLLM server (item 5)


@pytest.mark.parametrize("answer, says", [
    (lambda m, p, b: HTML, "GET /v1/models answered text/html '<!doctype html> <html><head><title>Jupyter Server"),
    (lambda m, p, b: as_json({"status": "ok"}), """GET /v1/models answered '{"status": "ok"}', without ['data'][0]['id']"""),
    (lambda m, p, b: as_json({"detail": "Not Found"}, 404), "GET /health answered HTTP 404"),
    (lambda m, p, b: (200, "text/plain", b"") if p == "/health" else as_json({"detail": "Not Found"}, 404),
     "GET /v1/models answered HTTP 404"),
])
def test_an_address_that_answers_but_not_as_vllm_is_refused_at_once_naming_it(answering, answer, says):
    asked = []
    server = answering(lambda m, p, b: asked.append((m, p)) or answer(m, p, b))
    with pytest.raises(NotAVLLMServer) as error:
        VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=server.url, startup_timeout=30))
    message = str(error.value)
    assert message.startswith(f"rollout.vllm_server: {server.url} is not a vLLM server") and says in message, message
    assert "\n" not in message and "python -m grpo_trainer serve" in message
    # Refused on its first answer, not after the 30 s start-up wait (nothing there will become vLLM): no request
    # was asked twice, where waiting polls GET /health every 0.5 s until startup_timeout.
    assert len(asked) == len(set(asked)), asked


def test_an_answer_without_what_vllm_sends_is_refused_naming_the_endpoint(answering):
    """A server that gets past the model check (an OpenAI-compatible server that is not vLLM, say) and then answers
    the log-prob probe without vLLM's fields."""
    fake = FakeVLLM()
    server = answering(lambda m, p, b: as_json({"choices": [{"text": "hi"}]}) if p == "/v1/completions" else fake(m, p, b))
    with pytest.raises(NotAVLLMServer, match=r"POST /v1/completions answered .*without \['choices'\]\[0\]\['logprobs'\]"):
        VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=server.url, weight_sync="none"))


def test_preflight_waits_for_a_refused_connection_and_refuses_a_non_vllm_answer_before_the_model_loads(answering, caplog):
    from grpo_trainer.preflight import run_preflight

    nobody = f"http://127.0.0.1:{free_port()}"  # a server still starting: waited for, up to startup_timeout
    cfg = load_config(None, ["rollout.engine=vllm_server", f"rollout.vllm_server.base_url={nobody}",
                             "rollout.vllm_server.startup_timeout=1.5"])
    started = time.monotonic()
    with caplog.at_level("INFO", logger="grpo_trainer"), pytest.raises(ConnectionError, match=f"no healthy vLLM server at {nobody} after 1.5s"):
        run_preflight(cfg)
    assert time.monotonic() - started >= 1.5
    assert f"waiting up to 1.5s (rollout.vllm_server.startup_timeout) for the vLLM server at {nobody}" in caplog.text
    html = answering(lambda m, p, b: HTML)
    with pytest.raises(NotAVLLMServer, match=html.url):
        run_preflight(load_config(None, ["rollout.engine=vllm_server", f"rollout.vllm_server.base_url={html.url}"]))
    run_preflight(load_config(None, ["rollout.engine=vllm_server", f"rollout.vllm_server.base_url={answering(FakeVLLM()).url}"]))


@pytest.mark.slow
def test_train_against_a_non_vllm_address_stops_in_one_line_before_anything_is_written(answering, tmp_path):
    html = answering(lambda m, p, b: HTML)
    out = tmp_path / "run"
    result = run_cli(["train", CONFIG, *small_run_overrides(out), "rollout.engine=vllm_server",
                      f"rollout.vllm_server.base_url={html.url}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: rollout.vllm_server: {html.url} is not a vLLM server" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()  # stopped before the model loaded


# ---------------------------------------------------------------------------- the disk push's folder (item 12)


def test_disk_pushes_of_two_runs_on_one_machine_go_to_folders_of_their_own_removed_at_close(answering):
    fake = FakeVLLM()
    server = answering(fake)
    settings = VLLMServerConfig(base_url=server.url, weight_sync="disk", push_probe=False)  # no model to score a probe
    engines = [VLLMServerEngine(SAMPLING, settings) for _ in range(2)]
    models = [nn.Linear(3, 2), nn.Linear(3, 2)]
    for version, (engine, model) in enumerate(zip(engines, models), start=1):
        engine.sync_weights(model, version=version)
    first, second = fake.loaded
    assert first.parent != second.parent  # one run's push does not overwrite the other's
    from safetensors.torch import load_file

    for weights, model in zip(fake.loaded, models):
        assert torch.equal(load_file(str(weights))["weight"], model.weight.detach())
        assert weights.parent.stat().st_mode & 0o777 == 0o700
    engines[0].sync_weights(models[0], version=3)
    assert fake.loaded[-1] == first  # the same run keeps its folder
    engines[0].close()
    assert not first.parent.exists() and second.is_file()
    engines[1].close()
    assert not second.parent.exists()


# ---------------------------------------------------------------------------- tools on a server (item 13)


class Restarting(Reconnects, Sleeps):
    """A vllm_server engine stand-in whose server goes away just before generate call `gone_at` and is back by the
    time anyone waits for it; it records what it was asked (and, unlike a server engine, it sleeps: so that the
    loop's sleep through a wrapper is seen too)."""

    def __init__(self, gone_at: int):
        self.gone_at, self.calls, self.waits, self.pushes, self.slept = gone_at, [], [], [], []
        self.weight_version = None

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        self.calls.append(max_tokens)
        if len(self.calls) - 1 == self.gone_at:
            raise ServerGone("http://127.0.0.1:1", "vLLM server at http://127.0.0.1:1 went away during GET /weight_info")
        ids = [[5, 6, 7, 8, 9, 10][: max_tokens or 6] for _ in prompt_ids for _ in range(num_generations)]
        return Rollout(ids, [False] * len(ids), sampling_logprobs=[[-1.0] * len(i) for i in ids])

    def reconnect(self, seconds):
        self.waits.append(seconds)
        return True

    def sync_weights(self, model, version=None, gather=None):
        self.pushes.append(version)
        self.weight_version = version

    def sleep(self):
        self.slept.append(True)

    def wake_up(self):
        pass

    def close(self):
        pass


def tools_engine(inner, max_len=6):
    from grpo_trainer.models import load_tokenizer
    from grpo_trainer.environments.tools import Tool, ToolBox
    from test_tools import tools_loop

    tokenizer = load_tokenizer(ModelConfig())
    box = ToolBox([Tool("add", {}, lambda a, b: str(a + b))], timeout=5, output_chars=100)
    return tools_loop(inner, box, tokenizer, max_len, 2)


def test_the_tools_engine_has_what_the_engine_it_wraps_has(tiny_model_path):
    inner = Restarting(gone_at=-1)
    engine = tools_engine(inner)
    assert capability(engine, Reconnects).reconnect(7.0) and inner.waits == [7.0]
    assert needs_weight_sync(engine)
    engine.sync_weights(nn.Linear(1, 1), version=4)
    assert inner.weight_version == 4 and inner.pushes == [4]
    capability(engine, Sleeps).sleep()
    assert inner.slept == [True]
    out = engine.generate([[1, 2]], 2, max_tokens=3)  # lowers the limit for this call
    assert inner.calls == [3] and [len(ids) for ids in out.completion_ids] == [3, 3]
    engine.generate([[1, 2]], 2, max_tokens=50)  # never above rollout.max_completion_length
    engine.generate([[1, 2]], 2)
    assert inner.calls == [3, 6, None]
    assert not hasattr(engine, "weight_version")  # only the protocol is forwarded: what the loop may ask an engine


def test_a_tools_run_whose_server_restarts_waits_for_it_and_pushes_again(tiny_model_path, caplog):
    """The queue waits for a server that went away (reconnect) through the tools wrapper as it does without
    tools; before, the wrapper had no way to wait and the run stopped at once, claiming a wait."""
    from test_async import server_run

    inner = Restarting(gone_at=1)  # step 2's sampling finds the server gone
    run = server_run(0, 3, engine=tools_engine(inner), overrides=["rollout.vllm_server.reconnect_timeout=300"])
    queue = run.rollouts
    queue.start(0)
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        for step in (1, 2, 3):
            mine, rollout = queue.take(step)
            assert len(rollout.completion_ids) == len(mine) * 2
            queue.after_update(step)
    assert inner.waits == [300.0]
    assert "the rollout server lost its weights (restarted?): pushing version 1 again" in caplog.text
    assert inner.pushes == [0, 1, 1, 2, 3]  # the recovery pushed the weights the server had lost
