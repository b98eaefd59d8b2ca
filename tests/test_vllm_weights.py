"""What every weight push sends (weight_sync.MergedWeights), without vLLM: the declaration matches the stream,
LoRA is merged as PEFT merges it, tied weights go once, and under ZeRO-3 (DeepSpeed, for real) the weights are
gathered one decoder layer at a time."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from vllm_helpers import ROOT, build_model, load_lm


def test_merged_weights_declare_what_they_stream_and_gather_one_layer_at_a_time(tmp_path):
    """The two channels agree (names, dtypes, shapes, order); LoRA is merged exactly as PEFT merges it; with a
    `gather`, only one decoder layer's parameters are whole at any time."""
    from peft import LoraConfig, get_peft_model

    from grpo_trainer.rollout.weight_sync import MergedWeights

    model_dir = build_model(tmp_path / "model")
    lm = load_lm(model_dir)
    peft = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    open_now: set[int] = set()
    widest: list[int] = []

    class Gather:  # records which parameters are "whole" at once
        def __init__(self, params):
            self.params = params

        def __enter__(self):
            assert not open_now
            open_now.update(id(p) for p in self.params)
            widest.append(len(self.params))

        def __exit__(self, *exc):
            open_now.clear()

    source = MergedWeights(peft, gather=Gather)
    meta = source.metadata()
    pushed = list(source)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in pushed]
    expected = copy.deepcopy(peft).merge_and_unload().state_dict()  # PEFT's own merge, on a copy
    for name, tensor in pushed:
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    base = load_lm(model_dir).state_dict()
    assert any(not torch.equal(t, base[n]) for n, t in pushed)  # the adapters did change something
    names = [n for n, _ in pushed]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1  # tied: once
    per_layer = sum(1 for p in load_lm(model_dir).model.layers[0].parameters()) + 2 * 2  # + lora_A/B of q and v
    assert max(widest) <= per_layer and len(widest) >= len(lm.model.layers) + 2


ZERO3 = """
import os, sys, json, types, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import LlamaConfig, LlamaForCausalLM
from grpo_trainer.rollout.weight_sync import MergedWeights, zero3_gather

deepspeed.init_distributed(dist_backend="gloo")
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=100, tie_word_embeddings=True)
torch.manual_seed(0)
full = LlamaForCausalLM(cfg)
with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}):
    sharded = LlamaForCausalLM(cfg)
with deepspeed.zero.GatheredParameters(list(sharded.parameters()), modifier_rank=0):
    sharded.load_state_dict(full.state_dict())
gather = zero3_gather(types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))))
whole_at_once = []

class Recorded:  # the real gather, counting the parameters that are whole while it is open
    def __init__(self, params):
        self.inner = gather(params)
    def __enter__(self):
        self.inner.__enter__()
        whole_at_once.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in sharded.parameters()))
    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

source = MergedWeights(sharded, gather=Recorded)
meta = source.metadata()  # full shapes, nothing gathered
assert not whole_at_once
reference = full.state_dict()
pushed = [(name, torch.equal(t, reference[name])) for name, t in source]
print(json.dumps({"meta": [[m.name, list(m.shape)] for m in meta], "pushed": pushed, "whole_at_once": whole_at_once,
                  "per_layer": sum(1 for _ in full.model.layers[0].parameters()),
                  "left_whole": sum(p.numel() > 0 for p in sharded.parameters())}))
"""


@pytest.mark.slow
def test_under_zero3_the_weights_are_gathered_one_layer_at_a_time_and_stream_whole():
    """DeepSpeed ZeRO-3 for real (one CPU process): the declaration has the full shapes without gathering, every
    tensor streams whole and equal to the unsharded model's, at most one decoder layer is whole at a time, and
    everything is sharded again afterwards."""
    from vllm_helpers import free_port

    out = subprocess.run([sys.executable, "-c", ZERO3, str(free_port())], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert result["meta"][0] == ["model.embed_tokens.weight", [100, 64]]
    assert [name for name, _ in result["pushed"]] == [name for name, _ in result["meta"]]
    assert all(equal for _, equal in result["pushed"]), result["pushed"]
    assert "lm_head.weight" not in dict(result["pushed"])  # tied: pushed once, as the embedding
    assert 1 <= max(result["whole_at_once"]) <= result["per_layer"] and len(result["whole_at_once"]) == 3 + 2
    assert result["left_whole"] == 0
