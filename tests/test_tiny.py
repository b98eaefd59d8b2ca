"""The tiny model's build is the same on every machine (build.build_canonically): the golden metrics and the
README's demo numbers depend on its weights."""

from __future__ import annotations

import hashlib

import pytest

from grpo_trainer.builtin import tiny, tiny_tools
from grpo_trainer.builtin.build import build_canonically
from grpo_trainer.builtin.charlm import build_tokenizer, char_llama_config


def weights_hash(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow  # two model builds in child processes
def test_the_canonical_build_does_not_depend_on_the_cpus_instructions_or_threads(tmp_path, monkeypatch):
    """A short warm start (30 steps) built twice: as builds run (one thread, MKL free to use the best
    instructions it finds: AVX-512 here), and on two threads with MKL held to AVX2. Built plainly, ATen's
    AVX-512 and AVX2 kernels gave different weights here."""
    build_canonically("grpo_trainer.builtin.tiny:build_model", tmp_path / "as_built", sft_steps=30)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    build_canonically("grpo_trainer.builtin.tiny:build_model", tmp_path / "avx2_two_threads", threads=2, sft_steps=30)
    assert weights_hash(tmp_path / "as_built") == weights_hash(tmp_path / "avx2_two_threads")


@pytest.mark.parametrize("module, count", [(tiny, "215,520"), (tiny_tools, "312,704")])
def test_the_parameter_count_in_the_docstring_is_the_models(module, count):
    """Counted on the meta device from the recipe's own shape, so no weights are built."""
    import torch
    from transformers import LlamaForCausalLM

    config = char_llama_config(build_tokenizer(), **module.SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert f"{sum(p.numel() for p in model.parameters()):,}" == count and count in module.__doc__
