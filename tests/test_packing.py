"""Prefix-shared packing (`train.packing`) and token-budget micro-batches (`train.micro_batch_tokens`) against
today's padded shared-prompt layout with a fixed micro-batch size: the same per-token log-probs, entropies, batch
loss and parameter gradients, for every loss type, on 1 and 2 ranks (threads standing in for ranks,
helpers.ThreadCollectives), with and without LoRA. (The multi-process run: tests/test_packing_ranks.py.)

"Equal" is float32's: two layouts sum the same products in different orders. Every tensor is compared to 1e-5 of
its own scale, |a - b| <= 1e-5 * max(1, max|b|); per-token values (log-probs, entropies) are of order 1-10, so that
is 1e-5 absolute to ~1e-4. A real error (a token attending to the wrong place, a row lost or counted twice, a
normaliser off) is of the order of the values themselves.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from grpo_trainer.batches import build_train_batch, budget_micro_batches, first_fit_decreasing, pieces_within, tokens_of
from grpo_trainer.config import ModelConfig, load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.geometry import batch_geometry
from grpo_trainer.losses import LOSS_TYPES, LOSS_VARIANTS
from grpo_trainer.models import (TokenLogprobs, check_packing_support, load_causal_lm, load_tokenizer,
                                 make_packed_batch, make_sequence_batch, pack_rows)
from grpo_trainer.run import reference_scorer
from grpo_trainer.terms import TermModels, build_terms
from grpo_trainer.train_state import TrainState
from grpo_trainer.update import LogprobSettings, LossSettings, add_logprobs, micro_batch_loss
from helpers import assert_as_exact_as, load_script, run_ranks, samples_share, training_samples

PAD = 0
G = 4


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str, tolerance: float = 1e-5) -> None:
    scale = max(1.0, float(b.abs().max()))
    worst = float((a - b).abs().max())
    assert worst <= tolerance * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"


# ----------------------------------------------------------------------------- the layout, by hand


def test_a_group_is_its_prompt_once_then_its_completions_without_their_last_tokens():
    """Prompt [1 2 3] with completions [4 5 6] and [7]; prompt [8 9] with [10 11]. Pieces of 3 + 2 + 0 = 5 and
    2 + 1 = 3 tokens: rows as long as the longest piece, so the second piece gets a row of its own (3 + 5 > 5)."""
    batch = make_packed_batch([[1, 2, 3], [1, 2, 3], [8, 9]], [[4, 5, 6], [7], [10, 11]], PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [8, 9, 10, PAD, PAD]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]  # completions continue their prompt
    assert batch.piece_ids.tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, -1, -1]]
    assert batch.member_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    # [4 5 6] is predicted by the prompt's last state (2), then by the states of 4 and 5 (3, 4); [7] by 2 alone;
    # [10 11] by row 1's states 1 and 2 (flat 5 + 1, 5 + 2).
    assert batch.score_index.tolist() == [[2, 3, 4], [2, 0, 0], [6, 7, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    # Short pieces share a row: four pieces of 4, 2, 2 and 1 tokens fill rows of 4 as [4], [2 2], [1].
    assert pack_rows([2, 4, 1, 2]) == [[1], [0, 3], [2]]


def test_each_completion_sees_its_prompt_and_itself_only():
    from grpo_trainer.models import packed_attention_mask

    batch = make_packed_batch([[1, 2], [1, 2]], [[3, 4, 5], [6, 7]], PAD)  # one row: 1 2 | 3 4 | 6
    allowed = packed_attention_mask(batch.piece_ids, batch.member_ids, "sdpa", torch.float32)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # token 6 sees the prompt and itself, not the other completion
    ]
    additive = packed_attention_mask(batch.piece_ids, batch.member_ids, "eager", torch.float32)[0, 0]
    assert ((additive == 0) == torch.tensor(allowed, dtype=torch.bool)).all()


def test_segments_are_each_prompt_and_each_completion_with_its_prefix_and_calls_are_planned_by_length():
    """The segment path's reading of packed rows (packed_attention.py): a prompt queries itself, a completion its
    prompt and itself; slack is no segment; every real token's output comes from exactly one call position and
    slack's from the zero row."""
    from grpo_trainer.packed_attention import Segment, SegmentLayout, plan_calls, segments_of

    # Row 0: prompt 1 2, completions 3 4 | 6 (as in the mask test); row 1: prompt 8, completion 9, slack.
    batch = make_packed_batch([[1, 2], [1, 2], [8]], [[3, 4, 5], [6, 7], [9, 10]], PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 6], [8, 9, PAD, PAD, PAD]]
    segments = segments_of(batch.piece_ids.tolist(), batch.member_ids.tolist())
    assert segments == [Segment(0, 0, 0, 2), Segment(0, 2, 2, 2), Segment(0, 2, 4, 1), Segment(5, 0, 5, 1),
                        Segment(5, 1, 6, 1)]
    # Longest keys first; a call closes when its padding would pass 25% of what its segments cost alone (here
    # every pair would pad more: five calls). SmolLM2's shapes: a prompt of 56 and its completions share a call
    # where they are of similar lengths; a 511-token completion stays alone.
    assert plan_calls(segments) == [[1], [2], [0], [4], [3]]
    recipe = [Segment(0, 0, 0, 56)] + [Segment(0, 56, 0, n) for n in (62, 62, 61, 60, 62, 58, 62, 62)]
    assert plan_calls(recipe) == [[1, 2, 5, 7, 8, 3, 4, 6, 0]]
    longtail = [Segment(0, 0, 0, 56), Segment(0, 56, 0, 511)] + [Segment(0, 56, 0, 20)] * 7
    assert plan_calls(longtail) == [[1], [2, 3, 4, 5, 6, 7, 8], [0]]
    layout = SegmentLayout.of(batch.piece_ids, batch.member_ids)
    first = layout.calls[0]  # completion 3 4 after the prompt 1 2: keys 1 2 3 4, its query 4 seeing all four
    assert first.keys.tolist() == [[0, 1, 2, 3]] and first.queries.tolist() == [[2, 3]]
    assert first.mask[0, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # Outputs are laid out call after call (2, 1, 2, 1, 1 positions), then the zero row (index 7).
    assert layout.take.tolist() == [3, 4, 0, 1, 2, 6, 5, 7, 7, 7]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_segment_attention_equals_the_dense_packed_mask(heads, kv_heads):
    """Random queries, keys and values over rows of several pieces with slack (grouped-query heads too): the
    segment path's outputs equal SDPA under the dense mask at every real token, in float64, and slack gets zeros."""
    from grpo_trainer.models import packed_attention_mask
    from grpo_trainer.packed_attention import SegmentLayout, segment_attention

    g = torch.Generator().manual_seed(3)
    prompts = [[1] * 5] * 3 + [[2] * 2] * 2 + [[3] * 7]
    completions = [[4] * n for n in (9, 2, 6, 1, 4, 12)]
    batch = make_packed_batch(prompts, completions, PAD)
    rows, width = batch.input_ids.shape
    q = torch.randn(rows, heads, width, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(rows, kv_heads, width, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = segment_attention(q, k, v, SegmentLayout.of(batch.piece_ids, batch.member_ids), 0.3)  # [R, L, H, D]
    mask = packed_attention_mask(batch.piece_ids, batch.member_ids, "sdpa", torch.float64)
    repeat = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask, scale=0.3).transpose(1, 2)
    real = batch.piece_ids >= 0
    assert (got[real] - want[real]).abs().max() < 1e-12
    assert (~real).any() and (got[~real] == 0).all()


def test_segments_run_where_they_pay_a_rule_on_the_lengths():
    """SEGMENTS_PAY on SmolLM2's recipe's shapes (a 56-token prompt, 8 completions a micro-batch): the end of
    the run (completions ~21 tokens, rows of ~190) keeps the dense mask; its first steps (63 tokens, rows of ~550)
    run segment by segment. A long tail (one completion of 511 among seven of 20: one row of 700) keeps the dense
    mask: the long completion's own query x key rectangle is most of the row's square."""
    from grpo_trainer.packed_attention import SegmentPlan

    def layout(lengths):
        batch = make_packed_batch([[1] * 56] * len(lengths), [[2] * n for n in lengths], PAD)
        plan = SegmentPlan.of(batch.piece_ids, batch.member_ids)
        assert plan.scores == sum(c.mask[:, 0].numel() for c in plan.layout().calls)  # what the calls compute
        return plan

    end, start, longtail = layout([47, 14, 7, 5, 10, 13, 9, 36]), layout([64] * 7 + [56]), layout([512] + [20] * 7)
    assert (end.rows * end.width**2 / end.scores, end.pays) == (pytest.approx(2.16, abs=0.01), False)
    assert (start.rows * start.width**2 / start.scores, start.pays) == (pytest.approx(4.52, abs=0.01), True)
    assert (longtail.rows * longtail.width**2 / longtail.scores, longtail.pays) == (pytest.approx(1.62, abs=0.01), False)


def test_the_sdpa_function_is_transformers_own_without_a_packed_layout():
    """packed_attention registers transformers' "sdpa" attention anew: a call without a layout (generation, the
    padded layout, another model) gives transformers' own function's output, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import grpo_trainer.packed_attention  # noqa: F401 (the registration)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    module = SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    registered = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert registered is not sdpa_attention_forward
    got, _ = registered(module, q, k, v, mask, dropout=0.0, scaling=0.5)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.5)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- the model's forward


@lru_cache(maxsize=1)
def tiny_batch():
    """4 prompts x G 4 from the tiny model's chat template; completions of 1 to 30 tokens."""
    tokenizer = load_tokenizer(ModelConfig())
    questions = ["What is 1+2?", "What is 13+40?", "What is 7+75?", "Add 12 and 9."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3, 30, 2, 7, 4, 1, 1, 12, 6, 8, 3, 17, 2]
    completions = [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]
    return [prompts[j // G] for j in range(len(completions))], completions


def tiny_lm(lora: bool = False, attention: str = "sdpa"):
    torch.manual_seed(0)
    lm = load_causal_lm(ModelConfig())
    if attention != "sdpa":
        lm.set_attn_implementation(attention)
    if lora:
        import peft

        lm = peft.get_peft_model(lm, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return lm.train()


# float64 too: there packed and the shared-prompt padded path agree to ~1e-15 (LoRA, measured), so what float32 shows
# is rounding, not a token seeing the wrong thing. (Under gradient checkpointing the padded reference is every row in
# full, left-padded, which differs from both by ~1e-7 of scale even in float64: hence 1e-6 there.) In float32 LoRA's
# gradients differ by up to 1.03e-5 of their scale on tiny-v4 (packed vs the full computation 9.7e-6, padded vs full
# 8.9e-7: a packed row sums more masked terms), hence 2e-5 for float32 gradients.
TOLERANCE = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-5, 2e-5)}  # (values, gradients)


def attention_path(monkeypatch, path: str) -> list[int]:
    """Packed rows through SDPA segment by segment (`segments`) or under one dense mask (`dense`), whatever the
    lengths would choose (packed_attention.SEGMENTS_PAY); the list returned grows by one per segment-path call."""
    from grpo_trainer import packed_attention

    monkeypatch.setattr(packed_attention, "SEGMENTS_PAY", 0.0 if path == "segments" else float("inf"))
    calls: list[int] = []
    real = packed_attention.segment_attention
    monkeypatch.setattr(packed_attention, "segment_attention", lambda *args: calls.append(1) or real(*args))
    return calls


# Not eager in float64: there the padded path itself gives NaN log-probs (the left-padded rows under transformers'
# eager mask; float32 is fine), so it is no reference. The eager path has one dense mask (no segments).
@pytest.mark.parametrize("variant,dtype,path", [
    (v, d, a) for v in ("plain", "lora", "eager", "gradient-checkpointing") for d in (torch.float64, torch.float32)
    for a in ("segments", "dense") if not (v == "eager" and (d == torch.float64 or a == "segments"))],
    ids=lambda x: str(x).replace("torch.", ""))
def test_packed_forward_equals_padded_values_and_gradients(tiny_model_path, variant, dtype, path, monkeypatch):
    """Every completion token's log-prob and entropy, and every trainable parameter's gradient, through the packed
    rows (attention segment by segment, or under one dense mask) vs the padded shared-prompt layout (vs every row
    in full under gradient checkpointing, the padded path's own fallback there; there the segments are recomputed
    in the backward, so a recomputation that took another path would show)."""
    segment_calls = attention_path(monkeypatch, path)
    lm = tiny_lm(lora=variant == "lora", attention="eager" if variant == "eager" else "sdpa").to(dtype)
    values, gradients = TOLERANCE[dtype]
    if variant == "gradient-checkpointing":
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, completions = tiny_batch()
    rows = [0, 1, 4, 5, 6, 9, 12, 15, 2]  # groups split and out of order
    weights = torch.linspace(0.5, 1.5, 30)
    results = {}
    for name, make in (("padded", make_sequence_batch), ("packed", make_packed_batch)):
        batch = make([prompts[j] for j in rows], [completions[j] for j in rows], PAD)
        lm.zero_grad(set_to_none=True)
        logp, entropy = TokenLogprobs(lm, chunk_size=7)(**batch.tensors(), with_entropy=True)
        (logp * batch.completion_mask * weights[: logp.shape[1]]).sum().backward()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad}
        results[name] = logp.detach() * batch.completion_mask, entropy * batch.completion_mask, grads
    assert bool(segment_calls) == (path == "segments")
    assert_same(results["packed"][0], results["padded"][0], "log-probs", values)
    assert_same(results["packed"][1], results["padded"][1], "entropies", values)
    for name, grad in results["padded"][2].items():
        assert_same(results["packed"][2][name], grad, name, gradients)
    assert all(g.abs().sum() > 0 for n, g in results["packed"][2].items() if "lora_" in n or variant != "lora")


def tiny_qwen2(**changes):
    """A random 2-layer Qwen2 (biases on q/k/v, grouped-query attention 4 on 2), float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, **changes)
    return Qwen2ForCausalLM(config).train()


def test_qwen2_takes_the_packed_mask_and_positions(tiny_model_path):
    """transformers 5.19's Qwen2 hands a 4D mask to attention unchanged, as Llama (tiny, SmolLM2) does."""
    lm = tiny_qwen2()
    check_packing_support(lm)
    prompts, completions = [[5, 6, 7], [5, 6, 7], [9, 8]], [[10, 11, 12], [13], [14, 15, 16, 17]]
    out = {}
    for name, make in (("padded", make_sequence_batch), ("packed", make_packed_batch)):
        lm.zero_grad(set_to_none=True)
        batch = make(prompts, completions, PAD)
        logp, _ = TokenLogprobs(lm)(**batch.tensors())
        (logp * batch.completion_mask).sum().backward()
        out[name] = logp.detach() * batch.completion_mask, [p.grad.clone() for p in lm.parameters()]
    assert_same(out["packed"][0], out["padded"][0], "log-probs")
    for i, (a, b) in enumerate(zip(out["packed"][1], out["padded"][1])):
        assert_same(a, b, f"gradient {i}")


def test_only_full_attention_through_a_mask_taking_path_can_pack(tiny_model_path):
    lm = tiny_lm()
    check_packing_support(lm)  # sdpa
    lm.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="train.packing.*flash_attention_2.*takes no custom mask"):
        check_packing_support(lm)
    with pytest.raises(ConfigError, match="train.packing.*sliding-window attention layers"):
        check_packing_support(tiny_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1))


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
@pytest.mark.parametrize("path", ["segments", "dense"])
def test_smollm2_packed_equals_padded(tiny_model_path, path, monkeypatch):
    """The real model (30 layers, 9 query heads on 3 key/value heads, 49k vocabulary) on real text. Log-probs and
    entropies to 1e-5 of the padded shared-prompt path's. Gradients: as close to the float64 model's as every row
    run in full in float32 is, within 3x. Measured on an AMD EPYC (AVX-512): packed 2.6e-4 of the scale, full
    1.5e-4; padded and full differed by only 1.3e-5 there (the same shapes round alike), so the packed path's
    own rounding (other shapes) cannot be held to that."""
    from grpo_trainer.config import load_config as load

    segment_calls = attention_path(monkeypatch, path)
    cfg = load("configs/smollm2_cpu.yaml")
    tokenizer = load_tokenizer(cfg.model)
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in ("What is 12+7?", "Name a colour.")]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in chat]
    texts = ["12 + 7 = 19.<|im_end|>", "It is 19", "Blue, the colour of the sky.<|im_end|>"]
    completions = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = [prompts[0], prompts[0], prompts[1]]
    kept = ("layers.0.", "layers.15.", "layers.29.", "embed_tokens")
    out = {}
    lm = load_causal_lm(cfg.model).train()
    for dtype, paths in ((torch.float32, ("full", "padded", "packed")), (torch.float64, ("exact",))):
        lm.to(dtype)  # the float64 model: the float32 weights, widened exactly
        for name in paths:
            make, share = (make_packed_batch, True) if name == "packed" else (make_sequence_batch, name == "padded")
            lm.zero_grad(set_to_none=True)
            batch = make(rows, completions, tokenizer.pad_token_id)
            logp, entropy = TokenLogprobs(lm, chunk_size=5, share_prompt=share)(**batch.tensors(), with_entropy=True)
            (logp * batch.completion_mask).sum().backward()
            out[name] = (logp.detach() * batch.completion_mask, entropy * batch.completion_mask,
                         {n: p.grad.clone() for n, p in lm.named_parameters() if any(k in n for k in kept)})
    assert len(segment_calls) == (30 if path == "segments" else 0)  # each layer of the one packed forward
    assert_same(out["packed"][0], out["padded"][0], "log-probs")
    assert_same(out["packed"][1], out["padded"][1], "entropies")
    assert_as_exact_as(out["packed"][2], out["full"][2], out["exact"][2], "packed gradients", factor=3.0)


# ----------------------------------------------------------------------------- the loss, over ranks and layouts

LAYOUTS = {
    # name: (packing, micro_batch_tokens)
    "padded": (False, None),  # today's layout: the reference
    "packed": (True, None),
    "padded, token budget": (False, 70),
    "packed, token budget": (True, 70),
}


def scored_samples():
    """The tiny batch as a step's samples: advantages with a zero group, a truncated completion (masked: DAPO),
    tool output inside two completions (no loss there), sampler log-probs."""
    prompts, completions = tiny_batch()
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(completions), generator=g)
    advantages[8:12] = 0.0  # a group whose rewards were all equal
    tool_mask = [[1] * len(c) for c in completions]
    tool_mask[4][10:20] = [0] * 10
    tool_mask[14][3:6] = [0] * 3
    samples = training_samples(
        prompts, completions, truncated=[j == 6 for j in range(len(completions))], loss_mask=tool_mask,
        sampler_logprobs=[(-torch.rand(len(c), generator=g)).tolist() for c in completions],
    )
    return samples, advantages


def perturbed(lm, scale: float, seed: int):
    """A copy of `lm` with every trainable weight moved a little: the old policy / the reference, so that ratios
    are not 1 and clipping and the KL term act."""
    other = copy.deepcopy(lm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


@lru_cache(maxsize=None)
def models(lora: bool):
    lm = tiny_lm(lora=lora)
    old = TokenLogprobs(perturbed(lm, 0.02, 1)).eval()
    reference = None if lora else TokenLogprobs(perturbed(lm, 0.02, 2)).eval()  # LoRA: the adapter-disabled base
    return TokenLogprobs(lm), old, reference


def run_step(loss_type: str, world: int, layout: str, lora: bool = False, entropy_coef: float = 0.0):
    """Phases 3-5 of a step without the optimizer, on `world` thread ranks: micro-batches, the log-prob passes
    (old policy, entropy selection over all ranks, reference), then every micro-batch's loss share and its
    gradient. Returns the batch loss, the gradient (summed over ranks: DDP's average x world, which update.py's
    scaling undoes), and each completion's log-probs and entropies, by global row."""
    policy, old, reference = models(lora)
    # A model of its own per rank for the passes that switch LoRA adapters off (a context, not thread-safe).
    olds = [old] + [copy.deepcopy(old) for _ in range(world - 1)]
    packing, budget = LAYOUTS[layout]
    overrides = ["train.prompts_per_step=4", f"rollout.num_generations={G}", "train.micro_batch_size=4",
                 "train.mini_batches=2", "train.num_iterations=2", "rollout.max_completion_length=32",
                 # 0.45, not 0.5: of the 71 ranked tokens, 0.5 puts the threshold on an order statistic, a value
                 # two completions share (same prefix) up to the last bit in one layout and not in another (1 ulp):
                 # a tie a selection cannot keep stable across layouts that round differently
                 f"loss.type={loss_type}", "loss.beta=0.04", "loss.top_entropy_quantile=0.45",
                 "loss.mask_truncated_completions=true"]
    if "epsilon_low" in LOSS_VARIANTS[loss_type].options.model_fields:  # an option of another type is refused
        overrides.append("loss.options.epsilon_low=0.005")
    if budget:
        overrides.append(f"train.micro_batch_tokens={budget}")
    if entropy_coef:
        overrides.append(f"loss.entropy_coef={entropy_coef}")
    cfg = load_config(None, overrides)
    samples, advantages = scored_samples()
    params = [p for p in policy.parameters() if p.requires_grad]

    def rank(r, comm):
        geometry = batch_geometry(cfg, world, r)
        mine = list(range(r * geometry.completions_per_rank, (r + 1) * geometry.completions_per_rank))
        batch = build_train_batch(
            samples_share(samples, mine), advantages[mine], PAD, micro_batch_size=geometry.micro_batch_size,
            micro_batch_tokens=budget, packing=packing, mask_truncated=True, skip_zero_advantage=False, group_size=G,
            mini_batches=geometry.mini_batches, comm=comm,
        )
        if budget:
            cost = tokens_of([samples.prompt_ids[j] for j in mine], [len(samples.completion_ids[j]) for j in mine], [j // G for j in range(len(mine))], packing)
            assert all(cost(mb.rows) <= budget for mb in batch.micro_batches)
        # The old policy scores the batch (so ratios are not 1); LoRA's reference is that model's base.
        plain = SimpleNamespace(distributed_type=DistributedType.NO)  # an accelerator that wraps nothing
        terms = build_terms(cfg, TermModels(reference=reference_scorer(cfg, reference, plain, olds[r])))
        add_logprobs(olds[r], batch, terms, comm, LogprobSettings.of(cfg))
        terms = tuple(term.for_step(batch, comm, TrainState.fresh(entropy_coef)) for term in terms)  # a collective
        settings = LossSettings.of(cfg, geometry)
        loss, grad, tokens = torch.zeros(()), [torch.zeros_like(p) for p in params], {}
        for mb in batch.micro_batches:
            logp, entropy = policy(**mb.sequences, with_entropy=True, entropy_grad=bool(entropy_coef))
            share, _ = micro_batch_loss(batch, mb, logp, settings, terms, entropy)
            for total, g in zip(grad, torch.autograd.grad(share, params, allow_unused=True)):
                total += 0 if g is None else g
            loss += share.detach()
            for i, j in enumerate(mb.rows):
                n = len(samples.completion_ids[mine[j]])
                tokens[mine[j]] = (logp[i, :n].detach(), entropy[i, :n].detach())
        return loss, grad, tokens, batch.window_sizes

    results = run_ranks(world, rank)
    tokens = {j: v for _, _, t, _ in results for j, v in t.items()}
    assert sorted(tokens) == list(range(16))  # every completion once, on some rank
    loss = sum(r[0] for r in results)
    grad = [sum(parts) for parts in zip(*(r[1] for r in results))]
    assert len({tuple(r[3]) for r in results}) == 1  # every rank makes the same number of backward passes
    return loss, grad, tokens


@lru_cache(maxsize=None)
def reference_step(loss_type: str, lora: bool):
    return run_step(loss_type, 1, "padded", lora)


def assert_same_step(got, want, tolerance: float = 1e-5):
    loss, grad, tokens = got
    assert_same(loss, want[0], "loss", tolerance)
    for i, (g, w) in enumerate(zip(grad, want[1])):
        assert_same(g, w, f"gradient of parameter {i}", tolerance)
    for j, (logp, entropy) in want[2].items():
        assert_same(tokens[j][0], logp, f"log-probs of completion {j}")
        assert_same(tokens[j][1], entropy, f"entropies of completion {j}")
    assert any(float(w.abs().sum()) > 0 for w in want[1])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_matches_the_padded_layout_on_one_and_two_ranks(tiny_model_path, loss_type, world):
    """num_iterations 2 (old log-probs), mini_batches 2, beta > 0 (reference), top-entropy selection, tool masks,
    a truncated completion masked, sampler log-probs. bnpo normalises per micro-batch, so it is compared only where
    the micro-batches hold the same completions (packed vs padded at a fixed size)."""
    want = reference_step(loss_type, False)
    layouts = ["packed"] if loss_type == "bnpo" else [name for name in LAYOUTS if name != "padded" or world > 1]
    # VESPO's ratio is a product over a completion's tokens, so float32 rounding of each log-prob adds up (loss off
    # by 1.6e-5 of scale here; in float64 packed and padded agree to 1e-16, measured): 5e-5 for it.
    tolerance = 5e-5 if LOSS_VARIANTS[loss_type].ratio == "sequence_product" else 1e-5
    for layout in layouts:
        assert_same_step(run_step(loss_type, world, layout), want, tolerance)


def test_the_entropy_term_matches_the_padded_layout_on_two_ranks(tiny_model_path):
    """loss.entropy_coef > 0: the entropies carry a gradient (TokenLogprobs(entropy_grad=True)) in the packed layout
    as in the padded one, and the term's token count is agreed over ranks whatever the micro-batches."""
    want = run_step("dapo", 1, "padded", entropy_coef=0.01)
    assert_same_step(run_step("dapo", 2, "packed, token budget", entropy_coef=0.01), want)
    without = reference_step("dapo", False)
    assert float((want[0] - without[0]).abs()) > 1e-4  # the term is in the loss


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_lora_matches_the_padded_layout(tiny_model_path, loss_type):
    """LoRA: gradients of the adapters only; the reference is the same model with its adapters switched off."""
    assert_same_step(run_step(loss_type, 2, "packed, token budget", lora=True), reference_step(loss_type, True))


# ----------------------------------------------------------------------------- the measuring script


def test_update_bench_counts_what_each_layout_computes(tmp_path, tiny_model_path):
    """scripts/update_bench.py --count-only (the token table of docs/performance.md): the same seeded spread every
    run, the packed layout computes no padding and fewer tokens, a budget bounds every layout's passes."""
    bench = load_script("update_bench")
    assert bench.completion_lengths("longtail", 32) == bench.completion_lengths("longtail", 32)
    out = tmp_path / "counts.json"
    assert bench.main(["--model", "builtin:tiny", "--count-only", "--budget", "600", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert rows["packed"]["padding"] == 0 < rows["padded"]["padding"]
    assert rows["packed"]["computed_tokens"] < rows["padded"]["computed_tokens"]
    assert rows["packed, 600 tokens"]["micro_batches"] < rows["padded, 600 tokens"]["micro_batches"]


def test_update_bench_times_packed_rows_both_ways_against_the_token_bound(tmp_path, tiny_model_path):
    """--dense-mask: each packed layout again under one dense mask (the attention before the segment path), and
    every row's token bound (its tokens over padded's) beside its time ratio."""
    bench = load_script("update_bench")
    out = tmp_path / "times.json"
    assert bench.main(["--model", "builtin:tiny", "--spread", "start", "--dense-mask", "--reps", "1", "--threads", "1",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert list(rows) == ["padded", "packed", "packed, dense mask"]
    assert rows["packed"]["computed_tokens"] == rows["packed, dense mask"]["computed_tokens"]
    for row in rows.values():
        assert row["token_bound"] == row["computed_tokens"] / rows["padded"]["computed_tokens"]
        assert row["of_bound"] == pytest.approx(row["ratio"] / row["token_bound"]) and row["seconds"] > 0


@pytest.mark.slow  # four processes
def test_update_bench_measures_each_layouts_peak_in_a_process_of_its_own(tmp_path, tiny_model_path):
    """--peaks: one process per layout, so each peak is its own; a shared process's later layouts read ~0 (its
    high-water mark, optimizer state included, is the first layout's), a fresh process's first update never does."""
    bench = load_script("update_bench")
    out = tmp_path / "peaks.json"
    assert bench.main(["--model", "builtin:tiny", "--peaks", "--budget", "600", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["layouts"]
    assert list(rows) == ["padded", "packed", "padded, 600 tokens", "packed, 600 tokens"]
    assert all(row["peak_mib"] > 0 for row in rows.values()), rows
    assert rows["packed"]["padding"] == 0 < rows["padded"]["padding"]
