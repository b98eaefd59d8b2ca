"""`rollout.lora_sync` without vLLM: the adapter/merged decision and its reasons, the adapter folders, `serve`'s
LoRA flags, and a server engine's fall-back to merged pushes when the first adapter push is refused. (Against
real vLLM: tests/test_vllm_lora.py.)"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.rollout import SamplingSettings, lora_sync
from grpo_trainer.rollout.engines import vllm_lora_rank
from grpo_trainer.rollout.lora_sync import AdapterFolders, ModelFacts, adapter_refusal, push_adapters
from grpo_trainer.rollout.vllm_server import LOAD_ADAPTER, Server, ServerError, VLLMServerEngine
from grpo_trainer.serve import serve_command
from helpers import ROOT

CONFIG = str(ROOT / "configs" / "demo_cpu.yaml")
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


def test_adapter_folders_refuse_a_model_without_lora(tmp_path):
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        AdapterFolders(tmp_path).write(tiny_peft().get_base_model())


def test_serve_adds_the_lora_flags(monkeypatch):
    monkeypatch.setattr("grpo_trainer.serve._cpu_only", lambda: True)
    server = ["rollout.engine=vllm_server", "rollout.vllm_server.weights_dir=/shared/w"]
    command, env = serve_command(config(*server, "rollout.lora_sync=auto", lora="model.lora.r=17"))
    assert " ".join(command).endswith("--enable-lora --max-lora-rank 32 --max-loras 2")
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    for merged in (config(*server), config(*server, "rollout.lora_sync=auto", lora="seed=0")):
        command, env = serve_command(merged)
        assert "--enable-lora" not in command and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    with pytest.raises(ConfigError, match=r"^serve: rollout.lora_sync=adapter: --api-server-count 2: vLLM loads"):
        serve_command(config(*server, "rollout.lora_sync=adapter"), vllm_args=["--api-server-count", "2"])
    command, env = serve_command(config(*server, "rollout.lora_sync=auto"), vllm_args=["--api-server-count=2"])
    assert "--enable-lora" not in command and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    with pytest.raises(ConfigError, match="set rollout.lora_sync instead"):
        serve_command(config(*server, "rollout.lora_sync=auto"), vllm_args=["--enable-lora"])


class NoLoraServer(Server):
    """A server without runtime LoRA loading, that records what it is asked."""

    def __init__(self):
        super().__init__("http://127.0.0.1:1", timeout=1)
        self.calls: list[tuple[str, dict | None]] = []

    def request(self, method, path, body=None, timeout=None, read=None):
        self.calls.append((path, body))
        if path == LOAD_ADAPTER:
            raise ServerError(f"vLLM server at {self.url} has no {LOAD_ADAPTER}: start it with --enable-lora")
        if path == "/v1/models":
            return [{"id": "base"}]
        return None


def engine_with(server: Server, lora_sync_mode: str, weights_dir: Path) -> VLLMServerEngine:
    """A server engine for `server`, skipping the start-up checks (which need a vLLM server)."""
    from grpo_trainer.config import VLLMServerConfig

    settings = VLLMServerConfig(weight_sync="disk", weights_dir=str(weights_dir))
    engine = VLLMServerEngine.__new__(VLLMServerEngine)
    engine.__dict__.update(settings=settings, servers=[server], sampling=SamplingSettings(eos_token_ids=[2], max_completion_length=8), seed=0,
                           weight_sync="disk", weights_dir=weights_dir, _remove_weights_dir=None, is_main_process=True,
                           weight_version=None, _pushes=0, _calls=0, _client=None, _transfer=None,
                           lora_sync=lora_sync_mode, adapters=AdapterFolders(weights_dir / "adapters"),
                           _adapter=(None, None), model_name="base")
    return engine


def test_auto_falls_back_to_merged_pushes_when_the_server_refuses_the_first_adapter(tmp_path, caplog):
    server = NoLoraServer()
    engine = engine_with(server, "auto", tmp_path)
    with caplog.at_level(logging.WARNING, logger=lora_sync.__name__):
        engine.sync_weights(tiny_peft(), version=0)
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.lora_sync=auto: pushing merged weights, not the LoRA adapter: vLLM server at http://127.0.0.1:1 has "
        f"no {LOAD_ADAPTER}: start it with --enable-lora"]
    assert engine.adapters is None and engine.weight_version == 0 and engine.sampled_model() == "base"
    reloads = [body for path, body in server.calls if path == "/collective_rpc"]
    assert reloads and reloads[0]["method"] == "grpo_reload_weights"  # the merged weights went out instead
    engine.sync_weights(tiny_peft(), version=1)
    assert [path for path, _ in server.calls].count(LOAD_ADAPTER) == 1  # asked once, at the first push


def test_adapter_mode_stops_when_the_server_refuses(tmp_path):
    engine = engine_with(NoLoraServer(), "adapter", tmp_path)
    with pytest.raises(ServerError, match=f"no {LOAD_ADAPTER}"):
        engine.sync_weights(tiny_peft(), version=0)


def test_the_registry_hands_the_decision_to_the_vllm_engines(monkeypatch):
    from grpo_trainer.rollout import registry

    built = {}
    monkeypatch.setattr("grpo_trainer.rollout.vllm_colocate.VLLMColocateEngine",
                        lambda *args, **kwargs: built.setdefault("colocate", kwargs))
    monkeypatch.setattr("grpo_trainer.rollout.vllm_server.VLLMServerEngine",
                        lambda *args, **kwargs: built.setdefault("server", kwargs))
    model = tiny_peft()
    sampling = SamplingSettings(eos_token_ids=[2], max_completion_length=8)

    def build(*overrides):
        built.clear()
        registry.build_engine(config(*overrides), sampling, get_model=lambda: model, pad_token_id=0, tokenizer=None,
                          full_parameters=None, rank=0, is_main_process=True)
        return next(iter(built.values()))

    assert build("rollout.lora_sync=adapter")["lora_rank"] == 8
    assert build("rollout.lora_sync=merged")["lora_rank"] is None
    server = ["rollout.engine=vllm_server", "rollout.vllm_server.weights_dir=/shared/w"]
    assert build(*server, "rollout.lora_sync=auto")["lora_sync"] == "auto"
    assert build("rollout.engine=vllm_server", "rollout.lora_sync=auto")["lora_sync"] == "merged"  # no weights_dir
