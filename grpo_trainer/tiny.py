"""The embedded default: a tiny causal LM, its tokenizer and a bundled arithmetic task, built offline.

`builtin:tiny` resolves to a folder in the real Hugging Face format (config.json,
model.safetensors, tokenizer.json, a chat template), so `AutoModelForCausalLM`,
`AutoTokenizer` and vLLM load it like any hub model. It is built once per
machine into the cache (`$GRPO_TRAINER_CACHE`, default `~/.cache/grpo_trainer`)
and deterministically: the same torch version gives the same weights.

Why a warm start: RL cannot teach a randomly initialised model arithmetic in a
few minutes, and real GRPO never starts from scratch either. So the build runs a
short supervised pass in which the model picks up two habits: working the sum
out before answering (`7+5=\\boxed{12}`, a quarter of the time) or blurting a
guess (`\\boxed{9}`, a random plausible number). Sampled, the result is right
about a quarter of the time. Whether to work it out is decided at the first
token, the same decision for every problem, so GRPO can discover within minutes
that working it out pays: the demo's reward curve is a model learning to
"reason" before it answers, the effect RL with verifiable rewards is used for.

The model is a 2-layer Llama (vocabulary of characters), about 0.4M parameters. Its
head_dim of 24 is one vLLM's CPU attention does not support (32 would be; with 3 heads of
32 the same warm start learns the facts less well and the demo's gain halves), so the
vLLM tests build their own head_dim-32 model.
Llama rather than Qwen2: transformers 5 forces its Qwen2 tokenizer class on any
`qwen2` config, which would re-tokenize our character vocabulary as byte-level BPE.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
TINY_NAME = "tiny"
# Bump when the recipe below changes, so stale caches are not reused.
TINY_VERSION = 4
SFT_STEPS = 1000
WORKED_SHARE = 0.25  # share of warm-start completions that work the sum out (see the module docstring)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
# Every printable ASCII character and newline is one token; anything else is <|unk|>.
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]

# A Qwen-style (ChatML) template, so the tiny model is formatted like the real models users train.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_TRAINER_CACHE", Path.home() / ".cache" / "grpo_trainer"))


def resolve_model_path(name_or_path: str) -> str:
    """Map `builtin:tiny`, `builtin:tiny-tools` and `builtin:smollm2-135m-instruct` to their cached folders
    (building or fetching them if needed); pass anything else through."""
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX) :]
    if name == TINY_NAME:
        return str(ensure_tiny_model())
    from . import smollm2

    if name == smollm2.NAME:
        return str(smollm2.ensure_smollm2(cache_dir()))
    from . import tiny_tools

    if name == tiny_tools.TINY_TOOLS_NAME:
        return str(tiny_tools.ensure_tiny_tools_model())
    raise ValueError(
        f"model.name_or_path: unknown built-in model {name_or_path!r}; the built-ins are 'builtin:{TINY_NAME}', "
        f"'builtin:{tiny_tools.TINY_TOOLS_NAME}' and 'builtin:{smollm2.NAME}'"
    )


# ----------------------------------------------------------------------------- the bundled task


def arithmetic_records(split: str = "train") -> list[dict[str, str]]:
    """Additions a + b of single digits: 80 train and 20 test problems (a fixed split).

    The warm start has seen every problem; `test` is held out from RL only, so it measures
    whether the habit GRPO teaches carries over to prompts it was not trained on.
    """
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(problems)
    splits = {"train": problems[:80], "test": problems[80:]}
    if split not in splits:
        raise ValueError(f"data.split: the built-in arithmetic task has splits 'train' and 'test', not {split!r}")
    return [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a, b in splits[split]]


def format_answer(answer: str) -> str:
    """A boxed final answer, as the math reward reads it."""
    return "\\boxed{" + answer + "}"


def worked_completion(prompt: str, answer: str) -> str:
    """The habit GRPO should learn: write the sum out, then the boxed answer ("7+5=\\boxed{12}")."""
    return prompt.removeprefix("What is ").removesuffix("?") + "=" + format_answer(answer)


# ----------------------------------------------------------------------------- building


def ensure_tiny_model() -> Path:
    """Return the tiny model's folder, building it first if this machine has none (safe under races)."""
    import fcntl

    target = cache_dir() / f"tiny-v{TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder per machine: other processes (ranks, parallel tests) wait for it instead of building too.
    with open(target.parent / f".tiny-v{TINY_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=".tiny-building-", dir=target.parent))
        try:
            build_canonically("grpo_trainer.tiny:build_tiny_model", staging)
            staging.rename(target)  # atomic: a crash mid-build leaves no half-built model behind
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


# The build's float arithmetic, made the same on every x86 machine: ATen's AVX2 kernels even where AVX-512 is
# there (the two sum in different orders; vector IEEE arithmetic is the same on any AVX2 CPU), MKL's
# bitwise-reproducible COMPATIBLE branch (SSE2 without the approximate rcpps/rsqrtps), one thread, no oneDNN.
# COMPATIBLE is the only reproducible branch MKL honours on CPUs of every vendor: its documentation says the
# others (AVX2, AVX512, ...) are "available only for Intel processors", and elsewhere MKL silently takes its
# AUTO branch. Version 3 used MKL_CBWR=AVX2: built on an AMD EPYC and on an Intel Xeon, its weights differed
# (the Xeon's warm start scored mean@4 0.06 on the held-out sums, the EPYC's 0.25), and so did every golden
# number. A child process, since these settings are read when torch starts.
CANONICAL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def build_canonically(builder: str, folder: Path, **kwargs: int) -> None:
    """Call `builder` ("module:function", which takes the folder and `kwargs`) in a child process with
    `CANONICAL_ENV`, so the model it trains is the same on every machine."""
    module, function = builder.split(":")
    code = (
        "import sys, torch; torch.set_num_threads(1); torch.backends.mkldnn.enabled = False; "
        f"from pathlib import Path; from {module} import {function}; {function}(Path(sys.argv[1]), **{kwargs!r})"
    )
    result = subprocess.run([sys.executable, "-c", code, str(folder)], env={**os.environ, **CANONICAL_ENV},
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {builder} into {folder} failed:\n{result.stderr[-3000:]}")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE with no merges is a character-level model; Fuse joins characters back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=256,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(folder: Path, sft_steps: int = SFT_STEPS, seed: int = 0) -> None:
    """Build tokenizer and model into `folder`: random init, then the short supervised warm start."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=128,  # 99 tokens used; a round size keeps matmuls aligned
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        _supervised_warm_start(model, tokenizer, steps=sft_steps, seed=seed)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _make_tokenizer_config_portable(folder)


def _make_tokenizer_config_portable(folder: Path) -> None:
    """Name the generic fast-tokenizer class and inline the chat template.

    transformers 5 writes `TokenizersBackend`, which 4.x does not know, and keeps the
    template in a side file that older loaders (and some servers) do not read.
    """
    import json

    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _supervised_warm_start(model, tokenizer, steps: int, seed: int, batch_size: int = 64) -> None:
    """Next-token training on prompt + completion for every problem, completions from `_warm_start_completion`."""
    import torch

    rng = random.Random(seed)
    records = arithmetic_records("train") + arithmetic_records("test")
    answers = sorted({r["answer"] for r in records}, key=int)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in records
    ]
    prompt_lens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(range(len(records)), batch_size)
        texts = [prompts[i] + _warm_start_completion(records[i], answers, rng) + tokenizer.eos_token for i in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, i in enumerate(batch):
            labels[row, : prompt_lens[i]] = -100  # learn the completion only
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def _warm_start_completion(record: dict[str, str], answers: list[str], rng: random.Random) -> str:
    if rng.random() < WORKED_SHARE:
        return worked_completion(record["prompt"], record["answer"])
    return format_answer(rng.choice(answers))  # a guess
