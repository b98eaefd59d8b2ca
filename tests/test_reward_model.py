"""Learned reward models (`rewards.N.model`): scores, batching, chat templates, loading errors, a training run.

The reward models are built here, offline: a 1-layer LlamaForSequenceClassification (num_labels=1) on the tiny
model's character tokenizer, saved with save_pretrained. Its score head is scaled up so that scores differ
visibly between texts (a fresh head gives logits of ~0.04).
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import yaml

from grpo_trainer.config import RewardConfig, RewardModelConfig, config_from_dict
from grpo_trainer.errors import ConfigError, RewardError
from grpo_trainer.metrics import read_metrics
from grpo_trainer.reward_model import load_reward_model
from grpo_trainer.rewards import compute_rewards, load_rewards
from grpo_trainer.builtin.charlm import build_tokenizer
from helpers import ROOT, run_cli, small_run_overrides

PROMPTS = ["What is 1+2?", "What is 9+9?", "What is 4+4?", "What is 0+7?", "Hi"]
COMPLETIONS = ["3", "9+9=\\boxed{18}", "\\boxed{8} because four and four make eight", "", "a longer completion, with more tokens"]


def build_reward_model(folder, chat_template="default", num_labels=1, seed=0, causal=False):
    """A tiny sequence-classification reward model (or a causal LM, to be refused) with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    if chat_template != "default":
        tokenizer.chat_template = chat_template
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (LlamaForCausalLM if causal else LlamaForSequenceClassification)(config)
    if not causal:
        with torch.no_grad():
            model.score.weight.mul_(50)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def plain_forward(path, text, add_special_tokens=False):
    """The reward model run by hand on one text, unpadded: the score everything else must agree with."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer(text, add_special_tokens=add_special_tokens, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def rm_reward(path, **model):
    return load_rewards([RewardConfig(model={"path": str(path), **model})], device="cpu")


def test_scores_are_a_plain_forward_of_the_chat_formatted_text(rm_path):
    rewards = rm_reward(rm_path, batch_size=2)
    assert rewards[0].name == "reward_model"
    batch = compute_rewards(rewards, PROMPTS[:2], COMPLETIONS[:2], [[1], [2]], {})
    # The tiny tokenizer's ChatML template, written out by hand: the prompt as the user, the completion as the assistant.
    texts = ["<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n",
             "<|im_start|>user\nWhat is 9+9?<|im_end|>\n<|im_start|>assistant\n9+9=\\boxed{18}<|im_end|>\n"]
    expected = [plain_forward(rm_path, t) for t in texts]
    assert batch.per_function[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert abs(expected[0] - expected[1]) > 1e-2  # the texts really score differently
    assert batch.metrics["rewards/reward_model/mean"] == pytest.approx(sum(expected) / 2, abs=1e-5)
    assert batch.metrics["rewards/reward_model/truncated"] == 0


def test_batch_size_does_not_change_the_scores(rm_path):
    one = rm_reward(rm_path, batch_size=1)[0].fn(PROMPTS, COMPLETIONS)
    for batch_size in (2, 3, 16):
        many = rm_reward(rm_path, batch_size=batch_size)[0].fn(PROMPTS, COMPLETIONS)
        assert many == pytest.approx(one, abs=1e-5), batch_size
    assert len({round(s, 3) for s in one}) == len(one)  # padding would show: every text scores differently


def test_the_reward_models_own_chat_template_is_used(tmp_path):
    template = ("{% for m in messages %}{{ m['role'].upper() + ': ' + m['content'] + '\n' }}{% endfor %}")
    path = build_reward_model(tmp_path / "rm", chat_template=template)
    rm = rm_reward(path)[0].fn
    assert rm.texts(["What is 1+2?"], ["3"]) == ["USER: What is 1+2?\nASSISTANT: 3\n"]
    conversation = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]]
    assert rm.texts(conversation, [[{"role": "assistant", "content": "3"}]]) == ["SYSTEM: Be brief.\nUSER: What is 1+2?\nASSISTANT: 3\n"]
    assert rm(["What is 1+2?"], ["3"]) == pytest.approx([plain_forward(path, "USER: What is 1+2?\nASSISTANT: 3\n")], abs=1e-5)
    # `model.chat_template` overrides the tokenizer's own.
    override = rm_reward(path, chat_template="{{ messages[-1]['content'] }}")[0].fn
    assert override.texts(["What is 1+2?"], ["3"]) == ["3"]


def test_without_a_chat_template_prompt_and_completion_are_plain_text(tmp_path, caplog):
    path = build_reward_model(tmp_path / "rm", chat_template=None)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        rm = rm_reward(path)[0].fn
    assert "rewards.0.model: the reward model's tokenizer" in caplog.text and "no chat template" in caplog.text
    assert rm.texts(["What is 1+2?"], ["3"]) == ["What is 1+2?3"]
    assert rm.texts([[{"role": "user", "content": "What is 1+2?"}]], [[{"role": "assistant", "content": "3"}]]) == ["What is 1+2?3"]
    assert rm(["What is 1+2?"], ["3"]) == pytest.approx([plain_forward(path, "What is 1+2?3", add_special_tokens=True)], abs=1e-5)


def test_long_texts_keep_their_end(rm_path):
    rewards = rm_reward(rm_path, max_length=12)
    batch = compute_rewards(rewards, PROMPTS, COMPLETIONS, [[1]] * 5, {})
    assert batch.metrics["rewards/reward_model/truncated"] == 5  # every ChatML text is longer than 12 characters
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\na longer completion, with more tokens<|im_end|>\n"
    tail = "ore tokens<|im_end|>\n"  # the last 12 tokens: 10 characters, <|im_end|>, newline
    assert build_tokenizer()(tail, add_special_tokens=False)["input_ids"] == build_tokenizer()(text)["input_ids"][-12:]
    assert float(batch.per_function[4, 0]) == pytest.approx(plain_forward(rm_path, tail), abs=1e-5)


def test_loaded_once_in_eval_mode_without_grads_in_the_policy_dtype(rm_path):
    first = rm_reward(rm_path)[0].fn
    again = load_rewards([RewardConfig(model=str(rm_path), alias="judge")], device="cpu")[0]
    assert again.name == "judge" and again.fn.model is first.model  # the training and eval tasks share one model
    assert not first.model.training and not any(p.requires_grad for p in first.model.parameters())
    assert first.model.dtype == torch.float32
    bf16 = load_rewards([RewardConfig(model=str(rm_path))], policy_dtype="bfloat16", device="cpu")[0].fn
    assert bf16.model.dtype == torch.bfloat16  # `auto` follows the policy
    fixed = load_rewards([RewardConfig(model={"path": str(rm_path), "dtype": "float32"})], policy_dtype="bfloat16", device="cpu")
    assert fixed[0].fn.model is first.model
    scores = bf16(PROMPTS, COMPLETIONS)
    assert scores == pytest.approx(first(PROMPTS, COMPLETIONS), abs=0.1) and all(isinstance(s, float) for s in scores)


def test_a_model_that_cannot_score_is_refused_naming_the_key_and_the_path(tmp_path, rm_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(RewardError, match=rf"rewards\.0\.model\.path: cannot load the reward model's config from '{missing}'"):
        load_rewards([RewardConfig(model=str(missing))], device="cpu")
    two = build_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardError, match=rf"rewards\.1\.model\.path: '{two}' has num_labels=2; a reward model gives one score"):
        load_rewards([RewardConfig(name="math_accuracy"), RewardConfig(model=str(two))], device="cpu")
    causal = build_reward_model(tmp_path / "causal", causal=True)
    with pytest.raises(RewardError, match=r"rewards\.0\.model\.path: .* is not a trained sequence-classification model: "
                                          r"1 weights are missing \(score.weight\)"):
        load_rewards([RewardConfig(model=str(causal))], device="cpu")


def test_config_entries():
    cfg = config_from_dict({"rewards": [{"name": "math_accuracy"}, {"model": "some/rm", "weight": 0.5}]})
    assert cfg.rewards[1].name == "reward_model" and cfg.rewards[1].model == RewardModelConfig(path="some/rm")
    assert config_from_dict(cfg.model_dump(mode="json")) == cfg  # what checkpoints store loads back
    for entry, message in [
        ({"name": "math_accuracy", "model": "x"}, "rewards.0: `model` makes this entry a reward model"),
        ({"name": "reward_model"}, "rewards.0: `name: reward_model` needs `model: PATH`"),
        ({"model": "x", "kwargs": {"a": 1}}, "rewards.0: `kwargs` are passed to reward functions"),
        ({"model": {"path": "x", "batchsize": 2}}, "rewards.0.model.batchsize: unknown key; did you mean 'rewards.0.model.batch_size'"),
        ({"model": {"path": "x", "batch_size": 0}}, "rewards.0.model.batch_size: Input should be greater than 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict({"rewards": [entry]})


@pytest.mark.slow
def test_demo_trains_with_the_reward_model_weighted_beside_math_accuracy(tmp_path, rm_path, tiny_model_path):
    config = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())
    config["rewards"] = [{"name": "math_accuracy"}, {"model": {"path": str(rm_path), "batch_size": 5}, "weight": 0.5}]
    config_path = tmp_path / "rm.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    result = run_cli(["train", str(config_path), *small_run_overrides(out, steps=2), "checkpoint.save_final_model=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rewards.1.model: reward model" in result.stderr and "float32 on cpu" in result.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        math_mean, rm_mean = row["rewards/math_accuracy/mean"], row["rewards/reward_model/mean"]
        assert row["reward"] == pytest.approx(math_mean + 0.5 * rm_mean, abs=1e-5)  # every sample scored by both
        assert row["rewards/reward_model/std"] > 0 and not math.isnan(rm_mean)
        assert row["rewards/reward_model/truncated"] == 0
    # The run's saved config loads back with the reward model, and `eval` scores with it.
    evaluated = run_cli(["eval", str(out / "config.yaml"), "eval.num_samples=4", "--k", "2"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "eval/reward_model/mean@2" in evaluated.stdout and "eval/math_accuracy/mean@2" in evaluated.stdout


# Two DeepSpeed ZeRO-3 ranks scoring with a reward model (the policy sharded, the reward model whole on every
# rank, in training and evaluation): tests/test_launch_files.py::test_each_shipped_launch_file_trains_two_steps[zero3],
# in the same launch as the shipped zero3.yaml.
