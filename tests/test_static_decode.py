"""The compiled decode step (`rollout.hf.compile`, rollout/static_decode.py): a static KV cache under
torch.compile, rows bucketed in powers of two, gives the eager loop's logits up to float rounding.

The decoder's own logic (static cache, live rows moved in place, the cache shrinking to the next bucket,
the engine sampling through it) is checked with dynamo's `eager` backend: the same static graphs, traced
but not turned into kernels, a few seconds. Inductor turning them into kernels took 1-3 minutes per
graph of the 2-layer tiny model on the 2-core CI machine, too long for `make test`, so that run is opt-in:
`GRPO_TRAINER_TEST_COMPILE=1 pytest tests/test_static_decode.py` (and scripts/gpu_check.sh's hf_compiled
row runs the inductor path with CUDA graphs on a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from grpo_trainer.config import ModelConfig
from grpo_trainer.models import left_padded, load_causal_lm, load_tokenizer, positions
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.decode import EagerDecoder, reserve_room
from grpo_trainer.rollout.hf import HFEngine
from grpo_trainer.rollout.static_decode import CompiledForward, StaticDecoder

BACKENDS = [
    "eager",
    pytest.param("inductor", marks=[
        pytest.mark.slow,
        pytest.mark.skipif(os.environ.get("GRPO_TRAINER_TEST_COMPILE") != "1",
                           reason="inductor compiles for minutes on a small CPU: set GRPO_TRAINER_TEST_COMPILE=1"),
    ]),
]


def _prefill(lm, prompts, pad_token_id):
    ids, mask = left_padded(prompts, pad_token_id)
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
    return out.past_key_values, mask, out.logits[:, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_static_compiled_decoder_gives_the_eager_logits_as_rows_finish(tiny_model_path, backend):
    tokenizer, lm = load_tokenizer(ModelConfig()), load_causal_lm(ModelConfig())
    lm.eval().config.use_cache = True
    texts = [("12+7=", "19 done"), ("3*45-6=", "129 yes"), ("8-1=", "7 ok it"), ("100+23=", "123 done")]
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in texts]  # left padding on the short ones
    feed = torch.tensor([tokenizer(c, add_special_tokens=False)["input_ids"][:6] for _, c in texts])
    compiled = CompiledForward(lm, backend=backend)
    runs = {}
    for kind in ("eager", "static"):
        cache, mask, _ = _prefill(lm, prompts, tokenizer.pad_token_id)
        if kind == "eager":
            reserve_room(cache, 8)
            decoder = EagerDecoder(lm, cache, mask)
        else:
            decoder = StaticDecoder(compiled, cache, mask, 8)
        rows, position, seen = torch.arange(4), mask.sum(-1), []
        with torch.no_grad():
            for step in range(feed.shape[1]):
                # Rows finish: 4 -> 3 live rows stay in the bucket of 4 (moved in place), then 1 (a bucket of 1).
                for at, keep in ((2, [1, 2, 3]), (4, [2])):
                    if step == at:
                        rows, position = rows[keep], position[keep]
                        decoder.keep(torch.tensor(keep))
                seen.append(decoder.forward(feed[rows, step], position))
                position = position + 1
        runs[kind] = seen
    assert [s.shape[0] for s in runs["static"]] == [4, 4, 3, 3, 1, 1]
    for eager, static in zip(runs["eager"], runs["static"]):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)

    # The engine with `rollout.hf.compile` samples through the same graphs (a bucket of 1 row, the same cache length).
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=8)
    engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id, compile="default")
    engine._compiled = compiled
    rollout = engine.generate(prompts[1:], 1, seeds=[0, 1, 2])
    assert len(rollout.completion_ids) == 3
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert 0 < len(ids) <= 8 and (ids[-1] == tokenizer.eos_token_id) != truncated
