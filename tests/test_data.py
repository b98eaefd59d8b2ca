"""Prompts from files and the bundled task: columns, chat template, system prompt, resumable order."""

from __future__ import annotations

import json

import pytest

from grpo_trainer.config import DataConfig
from grpo_trainer.data import PromptSampler, build_prompt_set, load_records
from grpo_trainer.errors import DataError
from grpo_trainer.models import load_tokenizer
from grpo_trainer.config import ModelConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(ModelConfig())


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_builtin_task_has_disjoint_train_and_test_splits():
    train = load_records(DataConfig(source="builtin:arithmetic", split="train"))
    test = load_records(DataConfig(source="builtin:arithmetic", split="test"))
    assert len(train) == 80 and len(test) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    a, b = train[0]["prompt"].removeprefix("What is ").removesuffix("?").split("+")
    assert int(train[0]["answer"]) == int(a) + int(b)


def test_local_jsonl_with_custom_columns_and_system_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "solution": "4", "level": 1}, {"question": "3+3?", "solution": "6", "level": 2}])
    cfg = DataConfig(source=str(path), prompt_column="question", answer_column="solution", system_prompt="Be brief.")
    records = load_records(cfg)
    prompts = build_prompt_set(cfg, tokenizer, records, context_length=256)
    assert prompts.texts[0] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompts.token_ids[1]) == prompts.texts[1]
    columns = prompts.reward_columns([1, 0, 0], "solution")
    # every column reaches the rewards, and the answer column also as `answer`
    assert columns["level"] == [2, 1, 1] and columns["solution"] == ["6", "4", "4"] and columns["answer"] == ["6", "4", "4"]


def test_parquet_and_csv_files_load(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    for name in ("d.parquet", "d.csv"):
        records = load_records(DataConfig(source=str(tmp_path / name)))
        assert [r["prompt"] for r in records] == ["a", "b"] and str(records[1]["answer"]) == "2"


def test_chat_message_prompts_and_plain_text_prompts(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "x"}])
    cfg = DataConfig(source=str(path), system_prompt="ignored: the record has its own")
    prompts = build_prompt_set(cfg, tokenizer, load_records(cfg), context_length=256)
    assert prompts.texts[0].startswith("<|im_start|>system\nS<|im_end|>") and "ignored" not in prompts.texts[0]
    plain = DataConfig(source="builtin:arithmetic", use_chat_template=False)
    text = build_prompt_set(plain, tokenizer, load_records(plain)[:1], context_length=256).texts[0]
    assert text.startswith("What is ") and "<|im_start|>" not in text


def test_data_errors_name_the_problem(tmp_path, tokenizer):
    with pytest.raises(DataError, match="file not found"):
        load_records(DataConfig(source=str(tmp_path / "missing.jsonl")))
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    cfg = DataConfig(source=str(path))
    with pytest.raises(DataError, match=r"column 'prompt' is not in the dataset .*its columns are: question, answer"):
        build_prompt_set(cfg, tokenizer, load_records(cfg), context_length=256)
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 300, "answer": "a"}])
    cfg = DataConfig(source=str(long))
    with pytest.raises(DataError, match=r"record 0: the prompt has \d+ tokens, more than the model's context length \(256\)"):
        build_prompt_set(cfg, tokenizer, load_records(cfg), context_length=256)
    cfg = DataConfig(source=str(path), prompt_column="question", max_prompt_length=3)
    with pytest.raises(DataError, match=r"more than data.max_prompt_length \(3\)"):
        build_prompt_set(cfg, tokenizer, load_records(cfg), context_length=256)
    with pytest.raises(DataError, match="unknown built-in task"):
        load_records(DataConfig(source="builtin:chess"))


def test_missing_chat_template_fails_before_training(tmp_path, tokenizer):
    tokenizer = load_tokenizer(ModelConfig())
    tokenizer.chat_template = None
    cfg = DataConfig(source="builtin:arithmetic")
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        build_prompt_set(cfg, tokenizer, load_records(cfg), context_length=256)


def test_sampler_order_is_a_function_of_its_state():
    sampler = PromptSampler(size=10, seed=3)
    first = sampler.next_indices(7)
    state = sampler.state_dict()
    rest = sampler.next_indices(8)  # crosses into epoch 1
    assert sorted(first + rest[:3]) == list(range(10))  # an epoch is a permutation
    resumed = PromptSampler(size=10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_indices(8) == rest
    assert PromptSampler(size=10, seed=4).next_indices(10) != PromptSampler(size=10, seed=3).next_indices(10)


def test_chat_template_kwargs_reach_the_template():
    """Qwen3's switch (`enable_thinking`) is a template variable: data.chat_template_kwargs passes it."""
    tokenizer = load_tokenizer(ModelConfig())
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    records = load_records(DataConfig(source="builtin:arithmetic"))[:2]
    plain = build_prompt_set(DataConfig(source="builtin:arithmetic"), tokenizer, records, context_length=256)
    off = build_prompt_set(DataConfig(source="builtin:arithmetic", chat_template_kwargs={"enable_thinking": False}),
                           tokenizer, records, context_length=256)
    assert off.texts == [text + "<no-think>" for text in plain.texts] and "<no-think>" not in plain.texts[0]
