"""The tool-calling demo: the multiplication task, the chat template with tools, the warm-started model, and
the script that measures the warm start (scripts/tiny_tools_warm_start.py)."""

from __future__ import annotations

import pytest

from grpo_trainer.builtin import tiny_tools
from grpo_trainer.builtin.tiny_tools import CHAT_TEMPLATE, PYTHON_TOOL, multiplication_records
from helpers import load_script

PROMPT = "<|im_start|>system\ntools: python<|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name":"python","arguments":{"code":"print(12*34)"}}</tool_call>'
CONVERSATION = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "print(12*34)"}}}]},
    {"role": "tool", "content": "408\n"},
    {"role": "assistant", "content": "\\boxed{408}"},
]


@pytest.fixture(scope="module")
def warm_start():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_tools.ensure_model()  # built once per machine (cached)
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def measure():
    return load_script("tiny_tools_warm_start")


def test_records_are_products_of_two_digit_numbers_in_a_fixed_split():
    train, test = multiplication_records("train"), multiplication_records("test")
    assert (len(train), len(test)) == (400, 100)
    assert train == multiplication_records("train") == multiplication_records()
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for record in train + test:
        a, b = record["prompt"].removeprefix("What is ").removesuffix("?").split("*")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and record["answer"] == str(int(a) * int(b))
    with pytest.raises(ValueError, match="splits 'train' and 'test', not 'validation'"):
        multiplication_records("validation")


def test_registered_as_built_ins():
    from grpo_trainer import builtin

    assert builtin.TASKS["multiplication"] is multiplication_records
    assert builtin.MODELS["tiny-tools"] is tiny_tools.ensure_model
    with pytest.raises(ValueError, match="'builtin:tiny-tools'"):
        builtin.resolve_model_path("builtin:nope")


def test_template_renders_tools_tool_calls_and_tool_messages():
    tokenizer = tiny_tools.build_tokenizer(CHAT_TEMPLATE)
    render = tokenizer.apply_chat_template
    assert render(CONVERSATION[:1], tools=[PYTHON_TOOL], add_generation_prompt=True, tokenize=False) == PROMPT
    assert render(CONVERSATION, tools=[PYTHON_TOOL], tokenize=False) == (
        PROMPT + CALL + "<|im_end|>\n<|im_start|>tool\n408\n<|im_end|>\n<|im_start|>assistant\n\\boxed{408}<|im_end|>\n"
    )
    # Without tools it is charlm.py's ChatML; several tools are listed by name; arguments as a JSON string pass through.
    assert render(CONVERSATION[:1], add_generation_prompt=True, tokenize=False) == PROMPT.split("<|im_end|>\n", 1)[1]
    other = {"type": "function", "function": {"name": "search", "description": "", "parameters": {}}}
    assert render(CONVERSATION[:1], tools=[PYTHON_TOOL, other], tokenize=False).startswith(
        "<|im_start|>system\ntools: python, search<|im_end|>\n")
    as_string = [{"role": "assistant", "content": "",
                  "tool_calls": [{"function": {"name": "python", "arguments": '{"code":"print(1)"}'}}]}]
    assert render(as_string, tokenize=False) == (
        '<|im_start|>assistant\n<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call><|im_end|>\n')
    # The warm start's own text is what the template writes.
    assert tiny_tools.tool_call_text("print(12*34)") == CALL
    assert tiny_tools.tool_turn_text("408\n") == "\n<|im_start|>tool\n408\n<|im_end|>\n<|im_start|>assistant\n"


def test_warm_start_loads_with_its_template(warm_start):
    model, tokenizer = warm_start
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert model.config.head_dim == 32 and model.config.max_position_embeddings == 256
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], tools=[PYTHON_TOOL], add_generation_prompt=True)
    assert tokenizer.decode(prompt["input_ids"]) == PROMPT


def test_warm_start_sometimes_calls_the_tool_and_gets_it_right(warm_start, measure):
    model, tokenizer = warm_start
    records = multiplication_records("test")
    probability = measure.tool_call_probability(model, tokenizer, records)
    assert 0.15 < sum(probability) / len(probability) < 0.45
    results = measure.sample_conversations(model, tokenizer, records[:16], samples=4, seed=0)  # 64, seeded
    tool = [r for r in results if r["tool"]]
    guess = [r for r in results if not r["tool"]]
    assert 6 <= len(tool) <= 32 and len(guess) >= 32
    assert sum(r["tool_ok"] for r in tool) >= len(tool) / 2 and sum(r["correct"] for r in tool) >= len(tool) / 2
    assert sum(r["correct"] for r in guess) <= 2


def test_python_tool_of_the_measurement(measure):
    assert measure.run_python_tool('{"name":"python","arguments":{"code":"print(12*34)"}}') == ("408\n", True)
    assert measure.run_python_tool('{"name":"python","arguments":{"code":"import os"}}')[1] is False
    assert measure.run_python_tool('{"name":"python"')[1] is False
