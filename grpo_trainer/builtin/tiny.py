"""The embedded default: a tiny causal LM, its tokenizer and a bundled arithmetic task, built offline.

`builtin:tiny` resolves to a folder in the real Hugging Face format (config.json,
model.safetensors, tokenizer.json, a chat template), so `AutoModelForCausalLM`,
`AutoTokenizer` and vLLM load it like any hub model. Its recipe is below; it is
trained in build.py's canonical float settings (the same weights on every CPU
of a kind), and the package ships those (build.py says why) so that every
machine gets the Xeon-built weights and a fresh
machine assembles the folder into the cache (`$GRPO_TRAINER_CACHE`, default
`~/.cache/grpo_trainer`) in a second instead of training for minutes.

Why a warm start: RL cannot teach a randomly initialised model arithmetic in a
few minutes, and real GRPO never starts from scratch either. So the build runs a
short supervised pass in which the model picks up two habits: working the sum
out before answering (`7+5=\\boxed{12}`, a quarter of the time) or blurting a
guess (`\\boxed{9}`, a random plausible number). Sampled, the result is right
about a quarter of the time. Whether to work it out is decided at the first
token, the same decision for every problem, so GRPO can discover within minutes
that working it out pays: the demo's reward curve is a model learning to
"reason" before it answers, the effect RL with verifiable rewards is used for.

The model is a 2-layer Llama (vocabulary of characters), 0.22M parameters (215,520). Its
head_dim of 24 is one vLLM's CPU attention does not support (32 would be; with 3 heads of
32 the same warm start learns the facts less well and the demo's gain halves), so the
vLLM tests build their own head_dim-32 model. Tokenizer, template and the model family: charlm.py.
"""

from __future__ import annotations

import random
from pathlib import Path

from .build import assembled_from_shipped_weights, load_weights
from .charlm import build_char_model, build_tokenizer

NAME = "tiny"
# Bump when the recipe below changes, so stale caches are not reused.
VERSION = 5  # 4: built with build.CANONICAL_ENV's MKL_CBWR=COMPATIBLE; 5: 4's weights, its tokenizer saved unpadded
FOLDER = f"{NAME}-v{VERSION}"  # its folder in the cache, and the name of its shipped weights
SFT_STEPS = 1000
WORKED_SHARE = 0.25  # share of warm-start completions that work the sum out (see the module docstring)
SHAPE = dict(hidden_size=96)  # on charlm's defaults: 2 layers, 4 query heads of 24, 2 key/value heads


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


def ensure_model() -> Path:
    """The tiny model's folder, assembled from the shipped weights first if this machine has none (build.py)."""
    return assembled_from_shipped_weights(FOLDER, build_model)


def build_model(folder: Path, sft_steps: int = SFT_STEPS, seed: int = 0, weights: Path | None = None) -> None:
    """Build tokenizer and model into `folder`: random init, then the short supervised warm start, or, given
    `weights` (what this recipe's canonical build saved: build.shipped_weights), those loaded instead."""
    tokenizer = build_tokenizer()
    warm_start = (
        load_weights(weights)
        if weights is not None
        else (lambda model: _supervised_warm_start(model, tokenizer, steps=sft_steps, seed=seed))
    )
    build_char_model(folder, tokenizer, SHAPE, seed, warm_start)


def _supervised_warm_start(model, tokenizer, steps: int, seed: int, batch_size: int = 64) -> None:
    """Next-token training on prompt + completion for every problem, completions from `_warm_start_completion`."""
    import torch

    rng = random.Random(seed)
    records = arithmetic_records("train") + arithmetic_records("test")
    answers = sorted({r["answer"] for r in records}, key=int)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
        )
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
