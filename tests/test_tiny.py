"""The tiny model's build is the same on every machine (tiny.build_canonically): the golden metrics and the
README's demo numbers depend on its weights."""

from __future__ import annotations

import hashlib

from grpo_trainer.tiny import build_canonically


def weights_hash(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_the_canonical_build_does_not_depend_on_the_cpus_instructions_or_threads(tmp_path, monkeypatch):
    """A short warm start (30 steps) built twice: MKL free to use the best instructions it finds (AVX-512 here),
    and MKL held to AVX2. Built plainly, ATen's AVX-512 and AVX2 kernels gave different weights here."""
    hashes = []
    for i, env in enumerate([{}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}]):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        build_canonically("grpo_trainer.tiny:build_tiny_model", tmp_path / str(i), sft_steps=30)
        hashes.append(weights_hash(tmp_path / str(i)))
    assert hashes[0] == hashes[1]
