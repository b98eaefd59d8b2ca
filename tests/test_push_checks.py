"""Weight pushes that fail loudly (issue 46, item 5), without vLLM: a push past its deadline stops in one line naming
the server, the method and the step, the last checkpoint intact; a server whose weights are not the pushed ones is
caught by the probe. Servers here are HTTP servers in a thread (test_bad_input_servers.Answering); the same faults
against a real CPU vLLM server (a stalled gloo broadcast, wrong bytes on the wire) are in tests/test_vllm_server.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_trainer.config import VLLMServerConfig
from grpo_trainer.rollout import PushFailed, SamplingSettings
from grpo_trainer.rollout.push_checks import (
    default_push_timeout,
    probe_tokens,
    tolerance,
    trainer_logprobs,
)
from grpo_trainer.rollout.vllm_server import CLEANUP_S, INCOMPLETE_VERSION, VLLMServerEngine
from helpers import run_cli, small_run_overrides
from test_bad_input_servers import CONFIG, Answering, FakeVLLM, as_json

SAMPLING = SamplingSettings(eos_token_ids=[2], max_completion_length=8)


def tiny_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


class Stalling(FakeVLLM):
    """The fake disk server, whose `stall_at`-th weight reload (counted from 1) never answers until `release`
    is set; it scores the push probe with `scorer`'s weights (None: it cannot, the probe is off), and answers
    generate with a fixed completion."""

    def __init__(self, stall_at: int | None = None, scorer=None):
        super().__init__()
        self.stall_at, self.scorer, self.reloads = stall_at, scorer, 0
        self.release = threading.Event()
        self.versions: list[str] = []

    def __call__(self, method, path, body):
        route = path.split("?")[0]
        if route == "/collective_rpc":
            self.reloads += 1
            if self.reloads == self.stall_at:
                self.release.wait(120)  # the data plane hangs (a reload that never ends, a dead NFS mount)
        if route == "/update_weight_version":
            self.versions.append(body["new_version"])
        if route == "/v1/completions" and body.get("prompt_logprobs") is not None:
            tokens = body["prompt"][0]
            lps = trainer_logprobs(self.scorer, tokens)
            answer = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(tokens[1:], lps)]
            return as_json({"choices": [{"index": 0, "prompt_logprobs": answer, "token_ids": [5]}]})
        if route == "/v1/completions" and body.get("logprobs") != 2:  # a generate call: n completions of [5, 6, EOS]
            return as_json({"choices": [{"index": i, "token_ids": [5, 6, 2], "finish_reason": "stop",
                                         "logprobs": {"token_logprobs": [-1.0, -1.0, -0.5]}} for i in range(body["n"])]})
        return super().__call__(method, path, body)


@pytest.fixture
def fake_server():
    started = []

    def start(fake):
        started.append((fake, Answering(fake)))
        return started[-1][1]

    yield start
    for fake, server in started:
        fake.release.set()
        server.close()


def test_the_default_deadline_grows_with_the_bytes_and_the_tolerance_with_the_dtype():
    assert default_push_timeout(0) == 60
    assert default_push_timeout(513 * 2**20) == pytest.approx(60 + 513 / 25)  # SmolLM2-135M in float32: ~81 s
    assert 590 < default_push_timeout(7e9 * 2) < 600  # 7B parameters in bfloat16: ~10 min
    assert tolerance(torch.float32) == 1e-3 and tolerance(torch.bfloat16) == 0.1 and tolerance(torch.float16) == 0.05
    assert tolerance(torch.float32, torch.bfloat16) == 0.1  # a server narrower than the trainer: the looser one
    assert tolerance(torch.float32, None) == 1e-3
    assert all(0 <= t < 100 for t in probe_tokens(128)) and len(set(probe_tokens(128))) == 8
    assert all(0 <= t < 20 for t in probe_tokens(20))


def test_a_disk_push_that_stalls_stops_within_its_deadline_naming_the_server_and_the_method(fake_server):
    fake = Stalling(stall_at=2)
    server = fake_server(fake)
    engine = VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=server.url, weight_sync="disk", push_timeout=1.5,
                                                         push_probe=False))
    lm = tiny_lm()
    engine.sync_weights(lm, version=1)
    assert fake.version == "1"
    started = time.monotonic()
    with pytest.raises(PushFailed) as failed:
        engine.sync_weights(lm, version=2)
    took = time.monotonic() - started
    assert str(failed.value) == (f"weight push version 2 to {server.url} (disk) did not complete within 1.5s "
                                 "(rollout.vllm_server.push_timeout)")
    assert 1.5 <= took < 1.5 + CLEANUP_S + 30, took  # a bound on hanging (loaded CI cores), not a speed
    assert fake.versions[-1] == INCOMPLETE_VERSION  # nothing samples from a half-loaded server
    engine.close()


def test_the_probe_passes_the_pushed_weights_and_stops_on_others_in_one_line(fake_server):
    lm = tiny_lm()
    fake = Stalling(scorer=lm)  # scores with the trainer's own weights: what a server that loaded the push does
    server = fake_server(fake)
    engine = VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=server.url, weight_sync="disk"))
    engine.sync_weights(lm, version=1)
    assert fake.version == "1" and engine.probe_seconds > 0
    fake.scorer = tiny_lm(seed=1)  # the server holds other weights than those pushed
    with pytest.raises(PushFailed, match=rf"^weight push version 2 to {server.url} \(disk\): the server does not hold "
                                         r"the pushed weights: its log-probs of the push probe differ from the "
                                         r"trainer's by [0-9.e-]+ nats on average \(max [0-9.e-]+; tolerance 0.001, "
                                         r"rollout.vllm_server.push_probe_tolerance\)$"):
        engine.sync_weights(lm, version=2)
    assert fake.version == INCOMPLETE_VERSION  # and generate says so (WeightsLost) before sampling from it
    # Off only when asked, explicitly.
    quiet = VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=server.url, weight_sync="disk", push_probe=False))
    quiet.sync_weights(lm, version=3)
    assert fake.version == "3"
    for e in (engine, quiet):
        e.close()


@pytest.mark.slow
def test_a_run_whose_push_stalls_stops_in_one_line_and_keeps_the_last_checkpoint(fake_server, tmp_path):
    """A real `train` run against the fake server: step 2's push (the third: the initial weights, step 1's, step 2's)
    never completes. The run stops within the deadline, in one line naming the step, the server and the method, and
    step 1's checkpoint is intact and the one a resumed run starts from; no step-2 checkpoint was begun."""
    from grpo_trainer.checkpoint import checkpoint_root, find_resume_checkpoint, verify

    fake = Stalling(stall_at=3)
    server = fake_server(fake)
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(["train", CONFIG, *small_run_overrides(out, steps=3), "rollout.engine=vllm_server",
                      f"rollout.vllm_server.base_url={server.url}", "rollout.vllm_server.weight_sync=disk",
                      "rollout.vllm_server.push_timeout=3", "rollout.vllm_server.push_probe=false",
                      "checkpoint.save_every=1"])
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    root = checkpoint_root(out)
    assert errors == [f"error: step 2: weight push version 2 to {server.url} (disk) did not complete within 3s "
                      f"(rollout.vllm_server.push_timeout); stopping: the last checkpoint in {root} is intact "
                      "(resume with checkpoint.resume=auto)"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert fake.reloads == 3 and fake.versions[-1] == INCOMPLETE_VERSION
    assert sorted(p.name for p in root.iterdir() if "step-" in p.name) == ["step-000001"]  # no step 2, not even staged
    assert verify(root / "step-000001") is None
    resume, _ = find_resume_checkpoint(out, "auto")
    assert resume is not None and Path(resume).name == "step-000001"
    print(f"run stopped {took:.1f}s after it started (deadline 3s)")
