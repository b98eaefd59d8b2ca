"""`rollout.lora_sync` without running vLLM: the adapter/merged decision and its reasons, the adapter folders,
`serve`'s LoRA flags, a server engine's fall-back to merged pushes when the first adapter push is refused (against
a small HTTP server answering as vLLM 0.32 without --enable-lora), and the decision as the engines the registry
builds act on it. (Against real vLLM: tests/test_vllm_lora.py.)"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer.config import VLLMServerConfig, load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.rollout import SamplingSettings, lora_sync, registry
from grpo_trainer.rollout.engines import vllm_lora_rank
from grpo_trainer.rollout.lora_sync import AdapterFolders, ModelFacts, adapter_refusal, push_adapters
from grpo_trainer.rollout.vllm_server import LOAD_ADAPTER, ServerError, VLLMServerEngine
from grpo_trainer.serve import serve_command
from helpers import ROOT
from test_bad_input_servers import Answering, FakeVLLM  # an HTTP server in a thread; what vLLM 0.32 answers

CONFIG = str(ROOT / "configs" / "demo_cpu.yaml")
SAMPLING = SamplingSettings(eos_token_ids=[2], max_completion_length=8)
LLAMA = ModelFacts("LlamaForCausalLM", moe=False)
EMBEDDING_LORA = {"LlamaForCausalLM": True, "Qwen2ForCausalLM": False}  # as vLLM's classes declare (None: unknown)


def config(*overrides: str, lora: str = "model.lora.r=8"):
    return load_config(CONFIG, [lora, "rollout.engine=vllm_colocate", *overrides])


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def tiny_peft():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def test_vllm_lora_rank_rounds_up_to_an_allowed_value():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 16, 17, 300, 320, 512)] == [1, 8, 8, 16, 32, 320, 320, 512]
    assert vllm_lora_rank(513) is None


@pytest.mark.parametrize("overrides, facts, fsdp, says", [
    ([], LLAMA, False, None),
    (["rollout.engine=vllm_server", "rollout.vllm_server.weights_dir=/shared/w"], LLAMA, False, None),
    (["model.lora.target_modules=[q_proj,lm_head]"], LLAMA, False, None),
    ([], LLAMA, True, "FSDP"),
    (["model.lora.r=600"], LLAMA, False, "model.lora.r=600 is above vLLM's largest max_lora_rank (512)"),
    ([], ModelFacts("Qwen3MoeForCausalLM", moe=True), False, "Qwen3MoeForCausalLM is a mixture of experts"),
    (["model.lora.target_modules=[q_proj,embed_tokens]"], ModelFacts("Qwen2ForCausalLM", False), False,
     "model.lora.target_modules has embed_tokens on Qwen2ForCausalLM: vLLM has no embedding LoRA for it"),
    (["model.lora.target_modules=[lm_head]"], ModelFacts("MyForCausalLM", False), False,
     "vLLM is not installed here to check"),
    (["rollout.engine=vllm_server"], LLAMA, False, "rollout.vllm_server.weights_dir is not set"),
])
def test_adapter_refusal_names_the_reason(overrides, facts, fsdp, says, monkeypatch):
    monkeypatch.setattr(lora_sync, "vllm_embedding_lora", EMBEDDING_LORA.get)
    reason = adapter_refusal(config(*overrides), facts, fsdp=fsdp)
    assert reason is None if says is None else says in reason


def test_no_lora_is_a_reason_too():
    assert "model.lora is not set" in adapter_refusal(config(lora="seed=0"), LLAMA, fsdp=False)


def test_moe_is_read_from_the_model_config():
    assert ModelFacts.of(SimpleNamespace(architectures=["MixtralForCausalLM"], num_local_experts=8)).moe
    assert not ModelFacts.of(SimpleNamespace(architectures=["LlamaForCausalLM"])).moe


def test_push_adapters_per_mode(monkeypatch, caplog):
    model = SimpleNamespace(config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    assert not push_adapters(config("rollout.lora_sync=merged"), model, fsdp=False)
    assert push_adapters(config("rollout.lora_sync=adapter"), model, fsdp=False)
    assert push_adapters(config("rollout.lora_sync=auto"), model, fsdp=False)
    assert not push_adapters(config("rollout.lora_sync=auto", lora="seed=0"), model, fsdp=False)  # no LoRA: no question
    with pytest.raises(ConfigError, match=r"^rollout.lora_sync=adapter: FSDP: .* \(rollout.lora_sync=auto pushes merged"):
        push_adapters(config("rollout.lora_sync=adapter"), model, fsdp=True)
    with caplog.at_level(logging.WARNING, logger=lora_sync.__name__):
        assert not push_adapters(config("rollout.lora_sync=auto"), model, fsdp=True)
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.lora_sync=auto: pushing merged weights, not the LoRA adapter: FSDP: only DeepSpeed ZeRO-3's adapter "
        "tensors are gathered for a push"]


def test_adapter_folders_write_each_version_under_a_new_name(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    model = tiny_peft()
    gathered: list[list[torch.nn.Parameter]] = []

    def gather(params):  # a ZeRO-3 gather records what it is asked to make whole
        gathered.append(params)
        return torch.no_grad()

    folders = AdapterFolders(tmp_path / "adapters")
    first = folders.write(model, gather)
    assert {id(p) for p in gathered[0]} == {id(p) for n, p in model.named_parameters() if "lora_" in n}
    written = load_file(str(first.path / "adapter_model.safetensors"))
    assert written and all(".lora_" in k for k in written)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    names = [first.name] + [folders.write(model).name for _ in range(3)]
    assert len(set(names)) == 4 and folders.current.lora_id == 4
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [f"v3-{folders.token}", f"v4-{folders.token}"]
    assert AdapterFolders(tmp_path / "adapters").token != folders.token  # another run never reuses a name
    reloaded = PeftModel.from_pretrained(tiny_llama(), str(folders.current.path))  # same base weights (seed 0)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, model(x).logits, atol=1e-6)


def test_the_adapters_kept_loaded_are_the_newest_k_plus_one_of_this_engine():
    """After loading version 5 with K = 2 (rollout.max_staleness): versions 3 and 4 stay (requests sent under the
    older weights may name them), 1-2 and another run's go; every rank reads the newest as the current one."""
    from grpo_trainer.rollout.lora_sync import ADAPTER_PREFIX, Adapter, newest_adapter, stale_adapters

    ours = [f"{ADAPTER_PREFIX}ab12-v{n}" for n in (1, 2, 3, 4, 5)]
    other = f"{ADAPTER_PREFIX}ff00-v9"
    held = [other, *ours, "base-model"]
    loaded = Adapter(ours[-1], 5, Path("unused"))
    assert stale_adapters(held, loaded, keep=3) == [other, ours[0], ours[1]]
    assert stale_adapters(held, loaded, keep=1) == [other, *ours[:4]]  # synchronous: only the current stays
    assert newest_adapter(ours[2:] + ["base-model"]) == ours[-1] and newest_adapter(["base-model"]) is None
    assert newest_adapter([f"{ADAPTER_PREFIX}ab12-v10", f"{ADAPTER_PREFIX}ab12-v9"]).endswith("-v10")  # numbers


def test_adapter_folders_keep_as_many_versions_as_asked(tmp_path):
    folders = AdapterFolders(tmp_path / "adapters", keep=3)
    model = tiny_peft()
    for _ in range(5):
        folders.write(model)
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [f"v{n}-{folders.token}" for n in (3, 4, 5)]


def test_adapter_folders_refuse_a_model_without_lora(tmp_path):
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        AdapterFolders(tmp_path).write(tiny_peft().get_base_model())


def test_serve_adds_the_lora_flags(monkeypatch):
    monkeypatch.setattr("grpo_trainer.serve._cpu_only", lambda: True)
    server = ["rollout.engine=vllm_server", "rollout.vllm_server.weights_dir=/shared/w"]
    command, env = serve_command(config(*server, "rollout.lora_sync=auto", lora="model.lora.r=17"))
    assert " ".join(command).endswith("--enable-lora --max-lora-rank 32 --max-loras 2")
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    # asynchronous rollouts: the K adapters before the current one stay loaded, and the next one is loaded beside them
    command, _ = serve_command(config(*server, "rollout.lora_sync=auto", "rollout.max_staleness=3", lora="model.lora.r=8"))
    assert " ".join(command).endswith("--max-loras 5")
    with pytest.raises(ConfigError, match="--max-loras.*rollout.max_staleness"):
        serve_command(config(*server, "rollout.lora_sync=auto"), vllm_args=["--max-loras", "8"])
    for merged in (config(*server), config(*server, "rollout.lora_sync=auto", lora="seed=0")):
        command, env = serve_command(merged)
        assert "--enable-lora" not in command and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    with pytest.raises(ConfigError, match=r"^serve: rollout.lora_sync=adapter: --api-server-count 2: vLLM loads"):
        serve_command(config(*server, "rollout.lora_sync=adapter"), vllm_args=["--api-server-count", "2"])
    command, env = serve_command(config(*server, "rollout.lora_sync=auto"), vllm_args=["--api-server-count=2"])
    assert "--enable-lora" not in command and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    with pytest.raises(ConfigError, match="set rollout.lora_sync instead"):
        serve_command(config(*server, "rollout.lora_sync=auto"), vllm_args=["--enable-lora"])


class NoLoraVLLM(FakeVLLM):
    """vLLM 0.32 as `serve` starts it for merged pushes: without --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1,
    so it has no /v1/load_lora_adapter route (FastAPI's 404 {"detail": "Not Found"}); it records the routes it is
    asked, in order."""

    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def __call__(self, method, path, body):
        self.asked.append(path.split("?")[0])
        return super().__call__(method, path, body)


@pytest.fixture
def no_lora():
    fake = NoLoraVLLM()
    server = Answering(fake)
    fake.url = server.url
    yield fake
    server.close()


def engine_with(url: str, lora_sync_mode: str, weights_dir: Path) -> VLLMServerEngine:
    """A server engine for the server at `url`, built by its own `__init__` (the start-up checks included)."""
    settings = VLLMServerConfig(base_url=url, weight_sync="disk", weights_dir=str(weights_dir), startup_timeout=10,
                                push_probe=False)  # the fake holds no model to score the probe with
    return VLLMServerEngine(SAMPLING, settings, lora_sync=lora_sync_mode)


REFUSED_PUSH = ["/pause", "/v1/models", LOAD_ADAPTER, "/resume"]  # the adapters held; the load refused; resumed
MERGED_PUSH = ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]


def fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == lora_sync.__name__]


def test_auto_falls_back_to_merged_pushes_when_the_server_refuses_the_first_adapter(no_lora, tmp_path, caplog):
    from safetensors.torch import load_file

    engine = engine_with(no_lora.url, "auto", tmp_path)
    assert no_lora.asked == ["/health", "/v1/models", "/is_paused", "/v1/completions", "/v1/completions"]  # start-up
    assert engine.adapters is not None and engine.model_name == "fake-model"  # adapters, until a server refuses one
    no_lora.asked.clear()
    model = tiny_peft()
    with caplog.at_level(logging.WARNING, logger=lora_sync.__name__):
        engine.sync_weights(model, version=0)
    [line] = fallback_lines(caplog)
    assert line.startswith("rollout.lora_sync=auto: pushing merged weights, not the LoRA adapter: vLLM server at "
                           f"{no_lora.url} has no {LOAD_ADAPTER}: start it with --enable-lora")
    assert no_lora.asked == REFUSED_PUSH + MERGED_PUSH  # the merged weights went out instead, in the same push
    assert engine.adapters is None and engine.weight_version == 0 and engine.sampled_model() == "fake-model"
    assert no_lora.version == "0"
    [weights] = no_lora.loaded
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    pushed = load_file(str(weights))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert pushed.keys() <= merged.keys() and q_proj in pushed
    assert all(torch.allclose(pushed[name], merged[name], atol=1e-6) for name in pushed)
    assert not torch.allclose(pushed[q_proj], tiny_llama().state_dict()[q_proj])  # base + delta, not the base alone
    no_lora.asked.clear()
    with caplog.at_level(logging.WARNING, logger=lora_sync.__name__):
        engine.sync_weights(model, version=1)
    assert no_lora.asked == MERGED_PUSH and no_lora.version == "1"  # asked once, at the first push
    assert len(fallback_lines(caplog)) == 1


def test_adapter_mode_stops_when_the_server_refuses(no_lora, tmp_path):
    engine = engine_with(no_lora.url, "adapter", tmp_path)
    no_lora.asked.clear()
    with pytest.raises(ServerError, match=f"no {LOAD_ADAPTER}: start it with --enable-lora"):
        engine.sync_weights(tiny_peft(), version=0)
    assert no_lora.asked == REFUSED_PUSH  # nothing else pushed, and the server samples again
    assert engine.weight_version is None and no_lora.version == "default" and not no_lora.loaded


def build(cfg, model):
    return registry.build_engine(cfg, SAMPLING, get_model=lambda: model, pad_token_id=0, tokenizer=None,
                                 full_parameters=None, rank=0, is_main_process=True)


def test_the_registry_hands_the_decision_to_the_server_engine(no_lora, tmp_path, caplog):
    """Built through the registry against a server: with weights_dir the first push asks for the adapter (under
    `auto`, refused here, merged from then on); without it the run pushes merged weights and never asks."""
    model = tiny_peft()
    server = ["rollout.engine=vllm_server", f"rollout.vllm_server.base_url={no_lora.url}",
              "rollout.vllm_server.weight_sync=disk", "rollout.vllm_server.startup_timeout=10",
              "rollout.vllm_server.push_probe=false"]  # the fake holds no model to score the probe with

    def first_push(*overrides):
        no_lora.asked.clear()
        engine = build(config(*server, *overrides), model)
        no_lora.asked.clear()
        try:
            engine.sync_weights(model, version=0)
        finally:
            engine.close()
        return no_lora.asked

    shared = f"rollout.vllm_server.weights_dir={tmp_path}"
    with caplog.at_level(logging.WARNING, logger=lora_sync.__name__):
        assert first_push(shared, "rollout.lora_sync=auto") == REFUSED_PUSH + MERGED_PUSH
        assert len(fallback_lines(caplog)) == 1
        caplog.clear()
        assert first_push("rollout.lora_sync=auto") == MERGED_PUSH  # no weights_dir: decided when built
        [line] = fallback_lines(caplog)
        assert "rollout.vllm_server.weights_dir is not set" in line
    assert first_push(shared, "rollout.lora_sync=merged") == MERGED_PUSH
    with pytest.raises(ServerError, match=f"no {LOAD_ADAPTER}"):
        first_push(shared, "rollout.lora_sync=adapter")
    assert no_lora.asked == REFUSED_PUSH


class RecordingLLM:
    """vLLM's `LLM` as the colocated engine uses it (starting vLLM itself takes half a minute): it records how it was
    started and what each push gave it."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = self
        self.pushes: list[tuple[str, object]] = []

    def add_lora(self, request):
        self.pushes.append(("add_lora", request))
        return True

    def remove_lora(self, lora_id):
        self.pushes.append(("remove_lora", lora_id))
        return True

    def collective_rpc(self, method, kwargs=None):
        self.pushes.append((method, sorted(name for name, _ in kwargs["weights"])))

    def reset_prefix_cache(self):
        pass


def test_the_registry_hands_the_decision_to_the_colocated_engine(monkeypatch):
    """The colocated engine built through the registry: vLLM started with LoRA at the rank the config asks (rounded
    up to one vLLM allows) and each push an adapter, or started without LoRA and each push merged weights."""
    import vllm

    from grpo_trainer.rollout import vllm_colocate

    monkeypatch.setitem(vars(vllm), "LLM", RecordingLLM)  # not setattr: its getattr would import vLLM's LLM
    monkeypatch.setattr(vllm_colocate, "_on_cpu", lambda: True)
    model = tiny_peft()

    def pushes(*overrides):
        engine = build(config(*overrides, lora="model.lora.r=5"), model)
        engine.sync_weights(model, version=0)
        engine.sync_weights(model, version=1)
        return engine  # the adapter folders are the engine's: removed with it

    engine = pushes("rollout.lora_sync=adapter")
    llm = engine.llm
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"], llm.kwargs["max_loras"]) == (True, 8, 2)
    (add, first), (again, second), remove = llm.pushes
    assert (add, again, remove) == ("add_lora", "add_lora", ("remove_lora", first.lora_int_id))
    assert first.lora_name != second.lora_name and Path(second.lora_path, "adapter_model.safetensors").is_file()
    llm = pushes("rollout.lora_sync=merged").llm
    assert "enable_lora" not in llm.kwargs
    merged = sorted(copy.deepcopy(model).merge_and_unload().state_dict())
    assert llm.pushes == [("grpo_reload_weights", merged)] * 2
