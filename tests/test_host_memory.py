"""grpo_trainer.cpu.heap.HeapTrimmer: freed heap pages handed back, where the trainer's phases peak, with the
same numbers."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_trainer.cpu import heap
from grpo_trainer.config import ModelConfig
from grpo_trainer.cpu.heap import HeapTrimmer
from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer, make_sequence_batch
from helpers import ROOT, run_in_fork, small_run_overrides
from test_rollout import _chat_prompts

glibc = pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")


FREED_IN_THE_MIDDLE = """
import json, os
import torch
from grpo_trainer.cpu.heap import HeapTrimmer

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

blocks, pins = [], []
for _ in range(3200):  # 200 MiB of 64 KiB blocks (below glibc's first mmap threshold: in the heap)
    blocks.append(torch.ones(16 * 1024))
    pins.append(torch.ones(256))  # after each block, staying: the freed blocks cannot merge into the heap's top
before = resident_mib()
del blocks
after_free = resident_mib()
trimmer = HeapTrimmer(enabled=True)
trimmer()
print(json.dumps({"before": before, "after_free": after_free, "after_trim": resident_mib(), "calls": trimmer.calls}))
"""


@glibc
def test_a_trim_hands_back_pages_freed_in_the_middle_of_the_heap():
    """In a fresh process (a heap no earlier test has shaped): blocks freed in the middle of the heap stay
    resident until the trim."""
    result = subprocess.run([sys.executable, "-c", FREED_IN_THE_MIDDLE], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    assert rss["before"] - rss["after_free"] < 50, rss  # glibc kept them
    assert rss["after_free"] - rss["after_trim"] > 150, rss
    assert rss["calls"] == 1


def test_disabled_or_without_glibc_it_does_nothing(monkeypatch):
    off = HeapTrimmer(enabled=False)
    off()
    off.watch_backward(torch.nn.Embedding(3, 2), [])
    assert not off.active and off.calls == 0 and not off._handles
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)  # musl, macOS
    nowhere = HeapTrimmer(enabled=True)
    nowhere()
    assert not nowhere.active and nowhere.calls == 0


@glibc
def test_by_default_it_trims_for_a_model_of_64_mib_or_more_on_the_cpu():
    small, large = torch.nn.Linear(4096, 4095, device="meta"), torch.nn.Linear(4096, 4096, bias=False, device="meta")
    assert HeapTrimmer.for_model(None, "cpu", large).active  # 4096 x 4096 float32: 64 MiB
    assert not HeapTrimmer.for_model(None, "cpu", small).active
    assert not HeapTrimmer.for_model(None, "cuda", large).active
    assert HeapTrimmer.for_model(True, "cuda", small).active and not HeapTrimmer.for_model(False, "cpu", large).active


@glibc
def test_the_backward_trims_at_the_embeddings_and_every_kth_layer_and_gradients_are_unchanged(tiny_model_path,
                                                                                               monkeypatch):
    """Tensor hooks (no new autograd nodes): the gradients bit for bit as without them; one trim per watched
    module and decoder pass in the backward (the shared-prompt layout makes two passes), none in a no-grad pass."""
    monkeypatch.setattr(HeapTrimmer, "LAYER_STRIDE", 1)
    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?"])
    batch = make_sequence_batch([prompts[0], prompts[0], prompts[1]], [[5, 7, 9], [4], [12, 3]], tokenizer.pad_token_id)
    lm = load_causal_lm(ModelConfig()).train()
    layers = list(lm.get_decoder().layers)

    def gradients():
        lm.zero_grad(set_to_none=True)
        logp, _ = TokenLogprobs(lm)(**batch.tensors())
        (logp * batch.completion_mask).sum().backward()
        return [p.grad.clone() for p in lm.parameters()]

    plain = gradients()
    trimmer = HeapTrimmer(enabled=True)
    trimmer.watch_backward(lm.get_input_embeddings(), layers)
    try:
        with torch.no_grad():
            TokenLogprobs(lm)(**batch.tensors())
        assert trimmer.calls == 0
        watched = gradients()
        copy.deepcopy(lm)  # the hooks travel with a copy of the model: nothing in them that cannot be copied
    finally:
        trimmer.unwatch()
    assert trimmer.calls == 2 * (1 + len(layers))
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert not any(module._forward_hooks for module in lm.modules())


def count_trims(out: str, result_file: str, overrides: list[str]) -> None:
    """In a forked child: a short run of a model object (the caller's own, as notebooks pass it), counting the
    trims (and whether any was a real malloc_trim), and what hooks the model keeps afterwards."""
    from transformers import AutoModelForCausalLM

    import grpo_trainer
    from grpo_trainer.builtin.tiny import ensure_model

    counted = {"calls": 0, "active": False}
    real_call = HeapTrimmer.__call__

    def call(self):
        counted["calls"] += 1
        counted["active"] = counted["active"] or self.active
        real_call(self)

    HeapTrimmer.__call__ = call
    HeapTrimmer.LAYER_STRIDE = 10**6  # in the backward: the input embeddings only
    model = AutoModelForCausalLM.from_pretrained(ensure_model())
    result = grpo_trainer.train(None, [f"output_dir={out}", *overrides], model=model)
    Path(result_file).write_text(json.dumps({**counted, "steps": result.steps_done, "loss": result.last_metrics["loss"],
                                             "logged": "host_memory/trim_seconds" in result.last_metrics,
                                             "hooks_left": sum(len(m._forward_hooks) for m in model.modules())}))


@glibc
def test_the_trainer_trims_at_its_phases_when_told_and_not_by_default_for_a_tiny_model(tmp_path):
    """`train.trim_host_memory=true`: per step, before the rollout, before each micro-batch's forward and
    backward, before the optimizer step, and in each backward where the gradient reaches the input embeddings
    (two decoder passes); `false`, and the default for a model this small: the calls do nothing and nothing is
    watched. The loss is the same either way."""
    results = {}
    for setting in ("true", "false", "null"):
        overrides = [*small_run_overrides(tmp_path, steps=2)[1:], "train.skip_zero_advantage=false",
                     f"train.trim_host_memory={setting}"]
        out = run_in_fork(count_trims, (str(tmp_path / setting), str(tmp_path / f"{setting}.json"), overrides))
        assert out.returncode == 0, out.stderr[-3000:]
        results[setting] = json.loads((tmp_path / f"{setting}.json").read_text())
    on, off, default = results["true"], results["false"], results["null"]
    # 2 steps x (rollout + 2 micro-batches x (forward + backward + 2 embedding passes) + optimizer step)
    assert on["active"] and on["calls"] == 2 * (1 + 2 * 4 + 1) and on["steps"] == 2 and on["logged"]
    assert on["hooks_left"] == off["hooks_left"] == 0
    assert not default["active"]  # the default leaves a model of less than 64 MiB (the tiny one) untrimmed
    assert not off["active"] and off["calls"] == 2 * (1 + 2 * 2 + 1) and off["loss"] == on["loss"] and not off["logged"]
