"""The compiled decode step (`rollout.hf.compile`, rollout/static_decode.py): a static KV cache under
torch.compile, rows bucketed in powers of two, gives the eager loop's logits up to float rounding.

Compiling is slow on a small CPU (two graphs of the 2-layer tiny model here: one per row bucket), hence `slow`.
"""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.config import ModelConfig
from grpo_trainer.models import left_padded, load_causal_lm, load_tokenizer, positions
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.decode import EagerDecoder, reserve_room
from grpo_trainer.rollout.hf import HFEngine
from grpo_trainer.rollout.static_decode import CompiledForward, StaticDecoder

pytestmark = pytest.mark.slow


def _prefill(lm, prompts, pad_token_id):
    ids, mask = left_padded(prompts, pad_token_id)
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
    return out.past_key_values, mask, out.logits[:, -1]


def test_the_static_compiled_decoder_gives_the_eager_logits_as_rows_finish(tiny_model_path):
    tokenizer, lm = load_tokenizer(ModelConfig()), load_causal_lm(ModelConfig())
    lm.eval().config.use_cache = True
    prompts = [tokenizer("12+7=", add_special_tokens=False)["input_ids"],
               tokenizer("3*45-6=", add_special_tokens=False)["input_ids"]]  # left padding on the first
    feed = torch.tensor([tokenizer("19 done", add_special_tokens=False)["input_ids"][:6],
                         tokenizer("129 yes", add_special_tokens=False)["input_ids"][:6]])
    compiled = CompiledForward(lm)
    runs = {}
    for kind in ("eager", "static"):
        cache, mask, _ = _prefill(lm, prompts, tokenizer.pad_token_id)
        if kind == "eager":
            reserve_room(cache, 8)
            decoder = EagerDecoder(lm, cache, mask)
        else:
            decoder = StaticDecoder(compiled, cache, mask, 8)
        rows, position, seen = torch.arange(2), mask.sum(-1), []
        with torch.no_grad():
            for step in range(feed.shape[1]):
                if step == 3:  # row 0 finishes: the static cache shrinks from a bucket of 2 rows to 1
                    rows, position = rows[1:], position[1:]
                    decoder.keep(torch.tensor([1]))
                seen.append(decoder.forward(feed[rows, step], position))
                position = position + 1
        runs[kind] = seen
    assert [s.shape[0] for s in runs["static"]] == [2, 2, 2, 1, 1, 1]
    for eager, static in zip(runs["eager"], runs["static"]):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)

    # The engine with `rollout.hf.compile` samples through the same graphs (same row buckets, same cache length).
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=8)
    engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id, compile="default")
    engine._compiled = compiled
    rollout = engine.generate(prompts[1:], 2, seeds=[0])
    assert len(rollout.completion_ids) == 2
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert 0 < len(ids) <= 8 and (ids[-1] == tokenizer.eos_token_id) != truncated
