r"""`builtin:tiny-tools` and `builtin:multiplication`: a tiny model that sometimes calls a python tool.

The demo for tool-integrated RL (multi-turn tool calling). The task, 2-digit by 2-digit products
("What is 12*34?", answer "408"; 400 train and 100 test problems), is one the tiny model cannot do in
its head but can with a python tool. The warm start calls the tool some of the time, in the Hermes/Qwen
format the chat template writes:

    <|im_start|>system\ntools: python<|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n
    <tool_call>{"name":"python","arguments":{"code":"print(12*34)"}}</tool_call><|im_end|>      (model)
    \n<|im_start|>tool\n408\n<|im_end|>\n<|im_start|>assistant\n                             (tool, not trained on)
    \boxed{408}<|im_end|>                                                                    (model)

and guesses the rest of the time (`\boxed{N}<|im_end|>`, N a random product of two 2-digit numbers).
The choice is made at the first completion token (`<` or `\`), the same for every problem, so GRPO can
learn to call the tool more: the reward and the tool-call rate rise together. Token counts: the prompt
with the tool offered is 56 tokens; a tool-using completion 113-115 (77 for the call and its EOS, 24-25
tool tokens, 12-13 for the answer); a guess 12-13.

The model is charlm.py's family (character vocabulary, 2-layer Llama, 0.31M parameters: 312,704) with hidden size
128 and 4 heads of 32 (vLLM's CPU attention supports head_dim 32), q/k/v/o biases and RoPE theta 100.
It has to copy digits: the operands from the prompt into the code, the tool's result into the answer.
Learnt from scratch, finding the attention heads that do this took 150-400 steps of 64 conversations,
varying with the seed, so layer 0's first three heads start out looking back the three fixed distances
involved (`init_copying_heads`); it then copies after about 50 steps of 32. Loss is on model-written
tokens only (not the prompt, not the tool's turn).

Measured (`python scripts/tiny_tools_warm_start.py`; 100 test prompts x 8 samples at temperature 1, the tool
run on each call, as the multi-turn rollout would):

    build (400 steps of 32 tool-using +         minutes of one core (canonical: one thread, AVX2 kernels);
    12 guessing conversations)                  shipped, so done once (build.py; docs/performance.md)
    P(first token is `<`), mean over prompts    0.306 (0.29-0.33 across the test prompts)
    tool-call rate (turns with `<tool_call>`)    0.286
    calls well-formed, printing the product     0.895
    accuracy when it calls the tool             0.847
    accuracy when it does not                   0.000
    accuracy overall                            0.242

Built with seeds 1 and 2 instead of 0: tool-call rate 0.318 and 0.235, accuracy with the tool 0.839
and 0.840, without 0.000; the recipe does not hinge on one seed (so neither on one machine's float
rounding). vLLM's CPU build scores a tool conversation within 3e-5 nats per token of transformers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from .build import assembled_from_shipped_weights, load_weights
from .charlm import build_char_model, build_tokenizer, next_turn_text
from .tiny import format_answer

NAME = "tiny-tools"
# Bump when the recipe below changes, so stale caches are not reused.
VERSION = 3  # 3: built with build.CANONICAL_ENV's MKL_CBWR=COMPATIBLE
FOLDER = f"{NAME}-v{VERSION}"  # its folder in the cache, and the name of its shipped weights
TOOL_SHARE = 0.27  # share of warm-start first turns that call the tool (see the module docstring)
SFT_STEPS = 400
ROPE_THETA = 100.0  # sharper positional attention than Llama's 10000, for copying digits at fixed distances
SPLIT_SIZES = {"train": 400, "test": 100}
SEED = 4321
SHAPE = dict(  # on charlm's defaults (2 layers, 4 query heads, 2 key/value heads)
    hidden_size=128,  # heads of 32, a size vLLM's CPU attention supports
    attention_bias=True,  # the biases carry the copying heads' positional pattern (`init_copying_heads`)
    rope_theta=ROPE_THETA,
)

# ChatML as in charlm.py, plus tools: a one-line system message naming them (the context is 256 positions),
# `tool` messages, and assistant tool calls as Hermes/Qwen `<tool_call>` + compact JSON + `</tool_call>`.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\ntools: ' }}"
    "{% for tool in tools %}"
    "{% set spec = tool.function if tool.function is defined else tool %}"
    "{{ (', ' if not loop.first else '') + spec.name }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% if message.tool_calls is defined and message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set call = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\":' + (call.name | tojson) + ',\"arguments\":' }}"
    "{% if call.arguments is string %}{{ call.arguments }}"
    "{% else %}{{ call.arguments | tojson(separators=(',', ':')) }}{% endif %}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The python tool's JSON schema, as `apply_chat_template(..., tools=[PYTHON_TOOL])` takes it.
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}


# ----------------------------------------------------------------------------- the task


def multiplication_records(split: str = "train") -> list[dict[str, str]]:
    """Products a*b of two 2-digit numbers: 400 train and 100 test problems (a fixed, seeded split)."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"data.split: the built-in multiplication task has splits 'train' and 'test', not {split!r}")
    problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(SEED).shuffle(problems)
    start = 0 if split == "train" else SPLIT_SIZES["train"]
    return [_record(a, b) for a, b in problems[start : start + SPLIT_SIZES[split]]]


def _record(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"What is {a}*{b}?", "answer": str(a * b)}


def tool_call_text(code: str) -> str:
    """One python tool call, exactly as the template renders it and the warm start writes it."""
    return (
        "<tool_call>"
        + json.dumps({"name": "python", "arguments": {"code": code}}, separators=(",", ":"))
        + "</tool_call>"
    )


def product_code(prompt: str) -> str:
    """The program the warm start writes for a prompt: `print(12*34)` for "What is 12*34?"."""
    return "print(" + prompt.removeprefix("What is ").removesuffix("?") + ")"


def tool_turn_text(content: str) -> str:
    """The tokens between the end of a tool-calling assistant turn and the next assistant turn."""
    return next_turn_text("tool", content)


# ----------------------------------------------------------------------------- building


def ensure_model() -> Path:
    """The model's folder, assembled from the shipped weights first if this machine has none (build.py)."""
    return assembled_from_shipped_weights(FOLDER, build_model)


def build_model(folder: Path, sft_steps: int = SFT_STEPS, seed: int = 0, weights: Path | None = None) -> None:
    """Build tokenizer and model into `folder`: copying heads at init, then the supervised warm start, or,
    given `weights` (what this recipe's canonical build saved: build.shipped_weights), those loaded instead."""
    tokenizer = build_tokenizer(CHAT_TEMPLATE)

    def warm_start(model) -> None:
        init_copying_heads(model, _copy_offsets(tokenizer))
        _supervised_warm_start(model, tokenizer, steps=sft_steps, seed=seed)

    build_char_model(
        folder,
        tokenizer,
        SHAPE,
        seed,
        load_weights(weights) if weights is not None else warm_start,
        rope_theta=ROPE_THETA,
    )


def _conversation(tokenizer, prompt: str, record: dict[str, str], guess: str | None = None) -> list[tuple[str, bool]]:
    """A warm-start conversation as (text, trained) segments: the prompt, then either the tool call,
    the tool's turn and the boxed result, or the boxed `guess`. Only model-written text is trained."""
    segments = [(prompt, False)]
    if guess is not None:
        return segments + [(format_answer(guess) + tokenizer.eos_token, True)]
    return segments + [
        (tool_call_text(product_code(record["prompt"])) + tokenizer.eos_token, True),
        (tool_turn_text(record["answer"] + "\n"), False),
        (format_answer(record["answer"]) + tokenizer.eos_token, True),
    ]


def _copy_offsets(tokenizer) -> list[int]:
    """How far back each copied digit stands from the position that predicts it: the prompt's first
    operand from the code's (the same for every problem), the tool's result from the boxed answer
    (one apart for 3- and 4-digit results)."""
    offsets: list[int] = []
    for a, b in ((12, 34), (34, 56)):  # products 408 and 1904
        record = _record(a, b)
        conversation = _conversation(tokenizer, prompt_text(tokenizer, record["prompt"]), record)
        ids, labels = _ids_and_labels(tokenizer, conversation, decide=True)
        text = [tokenizer.convert_ids_to_tokens(i) for i in ids]
        digits = [i for i, t in enumerate(text) if t.isdigit()]
        trained = [i for i in digits if labels[i] != -100]
        untrained = [i for i in digits if labels[i] == -100]
        # untrained digits: the two operands (4), then the tool's result; trained: the code's operands, the answer.
        if not offsets:
            offsets.append(trained[0] - 1 - untrained[0])
        offsets.append(trained[4] - 1 - untrained[4])
    return offsets


def init_copying_heads(model, offsets: list[int], amplitude: float = 2.0) -> None:
    """Point layer 0's first attention heads at fixed distances back, one head per offset.

    The query and key biases alone (no content) then score position n from query position m by
    sum_i amplitude^2 cos(((n - m) + offset) * theta_i): highest `offset` tokens back. Without this, a
    model this size sits on a plateau before it finds these heads itself (measured: 150-400 steps of 64
    conversations, varying with the seed); with it, it copies digits after about 50 steps of 32.
    """
    import torch

    attention = model.model.layers[0].self_attn
    head_dim = model.config.head_dim
    half = head_dim // 2
    theta = torch.tensor([ROPE_THETA ** (-2 * i / head_dim) for i in range(half)])
    with torch.no_grad():
        key_bias = attention.k_proj.bias.view(-1, head_dim)
        query_bias = attention.q_proj.bias.view(-1, head_dim)
        key_bias.zero_()
        key_bias[:, :half] = amplitude  # rotate_half pairs dimension i with i + half
        for head, offset in enumerate(offsets):
            query_bias[head, :half] = amplitude * torch.cos(-offset * theta)
            query_bias[head, half:] = amplitude * torch.sin(-offset * theta)


def _supervised_warm_start(
    model, tokenizer, steps: int, seed: int, tool_batch: int = 32, guess_batch: int = 12, lr: float = 3e-3
) -> None:
    """Next-token training on model-written tokens only (the prompt and the tool's turn are masked).

    Each step trains `tool_batch` tool-using and `guess_batch` guessing conversations over all products
    of two 2-digit numbers (copying digits is the skill, so every pair helps). The copying needs the
    tool-using ones, so they outnumber the guesses; the first completion token (the decision) is trained
    on every guess and only on enough tool calls that its target share is TOOL_SHARE.
    """
    import math

    import torch

    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    answers = [str(a * b) for a, b in pairs]
    decide_share = TOOL_SHARE / (1 - TOOL_SHARE) * guess_batch / tool_batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine down to a tenth
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / max(steps, 1))))
    )
    prompts = {}  # question -> prompt text (rendering the template is slow next to a step)
    pad = tokenizer.pad_token_id
    model.train()
    for _ in range(steps):
        loss_sum: Any = 0.0  # a tensor once the first batch is added (starting at 0.0 keeps the batch's dtype)
        count = 0
        for use_tool, size in ((True, tool_batch), (False, guess_batch)):  # apart: their lengths differ
            rows = []
            for a, b in rng.sample(pairs, size):
                record = _record(a, b)
                if record["prompt"] not in prompts:
                    prompts[record["prompt"]] = prompt_text(tokenizer, record["prompt"])
                guess = None if use_tool else rng.choice(answers)
                conversation = _conversation(tokenizer, prompts[record["prompt"]], record, guess)
                rows.append(
                    _ids_and_labels(tokenizer, conversation, decide=not use_tool or rng.random() < decide_share)
                )
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
            labels = torch.tensor([r + [-100] * (width - len(r)) for _, r in rows])
            logits = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, :-1]
            targets = labels[:, 1:]
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            )
            count += int((targets != -100).sum())
        (loss_sum / count).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def prompt_text(tokenizer, question: str) -> str:
    """The prompt for `question` with the python tool offered, as the trainer renders it."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tools=[PYTHON_TOOL], add_generation_prompt=True, tokenize=False
    )


def _ids_and_labels(tokenizer, segments: list[tuple[str, bool]], decide: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation given as (text, trained) segments; `decide=False` leaves the
    first trained token (the tool-or-guess decision) unlabelled."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    if not decide:
        labels[next(i for i, label in enumerate(labels) if label != -100)] = -100
    return ids, labels
