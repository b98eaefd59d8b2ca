"""The transformers-generate engine: groups of G, EOS kept, truncation flagged, and log-probs that match."""

from __future__ import annotations

import torch

from grpo_trainer.config import ModelConfig
from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer, make_sequence_batch
from grpo_trainer.rollout import build_engine


def test_hf_engine_groups_truncation_and_logprob_alignment(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is 1+2?", "What is 13+4?")  # different lengths: left padding is exercised
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    engine = build_engine("hf", get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id,
                          eos_token_ids=[tokenizer.eos_token_id], max_completion_length=16)
    torch.manual_seed(0)
    rollout = engine.generate(prompt_ids, num_generations=3)
    assert len(rollout.completion_ids) == 6 and len(rollout.truncated) == 6
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert (ids[-1] == tokenizer.eos_token_id) != truncated  # finished completions keep their EOS
        assert tokenizer.eos_token_id not in ids[:-1]
        assert len(ids) <= 16

    short = build_engine("hf", get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id,
                         eos_token_ids=[tokenizer.eos_token_id], max_completion_length=3).generate(prompt_ids, 2)
    assert all(short.truncated) and all(len(c) == 3 for c in short.completion_ids)

    # The training forward (padded batch, explicit positions) scores each completion exactly as the
    # model does on the lone, unpadded sequence.
    rows = [0, 0, 0, 1, 1, 1]
    batch = make_sequence_batch([prompt_ids[r] for r in rows], rollout.completion_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, entropy = TokenLogprobs(lm, chunk_size=5)(batch.input_ids, batch.attention_mask, batch.num_completion_tokens, with_entropy=True)
        for i, row in enumerate(rows):
            ids = torch.tensor([prompt_ids[row] + rollout.completion_ids[i]])
            n = len(rollout.completion_ids[i])
            direct = lm(ids).logits[0, -n - 1 : -1].log_softmax(-1).gather(-1, ids[0, -n:, None]).squeeze(-1)
            torch.testing.assert_close(logp[i, :n], direct, atol=1e-5, rtol=1e-5)
    assert (entropy >= 0).all() and (batch.completion_mask.sum(1) == torch.tensor([len(c) for c in rollout.completion_ids])).all()
