"""The hf engine and the training forward: groups of G, EOS kept, truncation flagged, log-probs that match,
and the shared-prompt paths (one prefill per group) equal to the plain ones."""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.config import ModelConfig
from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer, make_packed_batch, make_sequence_batch
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.hf import HFEngine
from helpers import assert_as_exact_as


def hf_engine(lm, tokenizer, max_completion_length: int, share_prompt: bool, **sampling) -> HFEngine:
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=max_completion_length, **sampling)
    return HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id, share_prompt=share_prompt)


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared-prompt", "full"])
def test_hf_engine_groups_truncation_and_logprob_alignment(tiny_model_path, share_prompt):
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is 1+2?", "What is 13+4?")  # different lengths: left padding is exercised
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    engine = hf_engine(lm, tokenizer, 16, share_prompt)
    torch.manual_seed(0)
    rollout = engine.generate(prompt_ids, num_generations=3)
    assert len(rollout.completion_ids) == 6 and len(rollout.truncated) == 6
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert (ids[-1] == tokenizer.eos_token_id) != truncated  # finished completions keep their EOS
        assert tokenizer.eos_token_id not in ids[:-1]
        assert len(ids) <= 16

    short = hf_engine(lm, tokenizer, 3, share_prompt).generate(prompt_ids, 2)
    assert all(short.truncated) and all(len(c) == 3 for c in short.completion_ids)

    # The training forward (padded batch, explicit positions) scores each completion exactly as the
    # model does on the lone, unpadded sequence.
    rows = [0, 0, 0, 1, 1, 1]
    batch = make_sequence_batch([prompt_ids[r] for r in rows], rollout.completion_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, entropy = TokenLogprobs(lm, chunk_size=5, share_prompt=share_prompt)(**batch.tensors(), with_entropy=True)
        for i, row in enumerate(rows):
            ids = torch.tensor([prompt_ids[row] + rollout.completion_ids[i]])
            n = len(rollout.completion_ids[i])
            direct = lm(ids).logits[0, -n - 1 : -1].log_softmax(-1).gather(-1, ids[0, -n:, None]).squeeze(-1)
            torch.testing.assert_close(logp[i, :n], direct, atol=1e-5, rtol=1e-5)
    assert (entropy >= 0).all() and (batch.completion_mask.sum(1) == torch.tensor([len(c) for c in rollout.completion_ids])).all()


def _chat_prompts(tokenizer, questions):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8}, {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
                                      {"min_p": 0.05, "temperature": 1.5}, {"repetition_penalty": 1.8, "temperature": 0.9}])
def test_own_decode_loop_draws_the_same_tokens_as_generate(tiny_model_path, sampling):
    """For one prompt and one completion both engines make the same random draws: same seed, same tokens.

    (In a batch the streams part ways once a row finishes: `generate` keeps drawing for finished rows,
    our loop drops them. Each row's draw is still from the same distribution.)"""
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    prompt_ids = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+4?", "What is 7+75?", "What is 100+1?"])
    out = {}
    for share_prompt in (True, False):
        engine = hf_engine(lm, tokenizer, 12, share_prompt, **sampling)
        out[share_prompt] = engine.generate(prompt_ids * 3, 1, seeds=list(range(len(prompt_ids) * 3)))
    assert out[True].completion_ids == out[False].completion_ids
    assert out[True].truncated == out[False].truncated
    assert len(set(map(tuple, out[True].completion_ids))) > len(prompt_ids)  # really sampled, not one fixed answer


def test_sample_next_token_keeps_only_the_top_k_and_the_nucleus():
    from grpo_trainer.rollout.hf import sample_next_token

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sample_next_token(logits, top_k=2).tolist()) == {0, 1}
    assert set(sample_next_token(logits, top_p=0.75).tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert set(sample_next_token(logits, top_p=0.5).tolist()) == {0}  # the most likely token always stays
    counts = torch.bincount(sample_next_token(logits), minlength=4) / 2000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04, rtol=0)
    assert sample_next_token(torch.tensor([[0.0, 2.0, 1.0, 0.0]]), do_sample=False).tolist() == [1]


def test_sample_next_token_min_p_and_repetition_penalty_by_hand():
    from grpo_trainer.rollout.hf import sample_next_token

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    torch.manual_seed(0)
    assert set(sample_next_token(logits, min_p=0.2).tolist()) == {0, 1, 2}  # 0.05 < 0.2 x 0.5
    assert set(sample_next_token(logits, min_p=0.5).tolist()) == {0, 1}  # 0.15 < 0.25
    # CTRL's penalty on seen tokens: positive logits divided, negative multiplied; unseen ones untouched.
    seen = torch.tensor([[True, False]])
    greedy = dict(do_sample=False, repetition_penalty=1.1, occurred=seen)
    assert sample_next_token(torch.tensor([[2.0, 1.9]]), **greedy).tolist() == [1]  # 2.0 / 1.1 = 1.82 < 1.9
    assert sample_next_token(torch.tensor([[2.0, 1.7]]), **greedy).tolist() == [0]  # 1.82 > 1.7
    assert sample_next_token(torch.tensor([[-1.0, -1.05]]), **greedy).tolist() == [1]  # -1.0 x 1.1 = -1.1 < -1.05
    assert sample_next_token(torch.tensor([[-1.0, -1.05]]), do_sample=False).tolist() == [0]  # no penalty


def test_sample_next_token_draws_what_torch_multinomial_draws():
    """The sampler skips multinomial's argument checks but must consume the random stream as it does."""
    from grpo_trainer.rollout.hf import sample_next_token

    for seed in range(50):
        logits = torch.randn(8, 49152 if seed % 2 else 97, generator=torch.Generator().manual_seed(seed)) * 4
        torch.manual_seed(seed)
        expected = torch.multinomial(logits.softmax(-1), 1).squeeze(1)
        torch.manual_seed(seed)
        assert torch.equal(sample_next_token(logits), expected)
    with pytest.raises(FloatingPointError, match="not finite"):
        sample_next_token(torch.tensor([[0.0, float("nan")]]))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_shared_prompt_forward_equals_full_sequences_values_and_gradients(tiny_model_path, checkpointing):
    """One pass per distinct prompt + completions on its cache == every row in full, for log-probs,
    entropies and parameter gradients (as close to the float64 model's as the full rows', helpers.assert_as_exact_as).
    Groups split across the batch, prompts of different lengths and completions of 1 token are all in it. Under
    gradient checkpointing the shared path falls back to the full one."""
    tokenizer = load_tokenizer(ModelConfig())
    prompt_ids = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?", "What is 7+75?"])
    rows = [0, 0, 1, 2, 2, 2, 1]
    g = torch.Generator().manual_seed(0)
    completions = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 1, 9, 3, 1, 7, 9)]
    batch = make_sequence_batch([prompt_ids[r] for r in rows], completions, tokenizer.pad_token_id)
    assert batch.prompt_ids.shape[0] == 3 and batch.prompt_index.tolist() == [0, 0, 1, 2, 2, 2, 1]
    results = {}
    for dtype, share_prompt in ((torch.float32, True), (torch.float32, False), (torch.float64, False)):
        lm = load_causal_lm(ModelConfig()).to(dtype)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
        logp, entropy = TokenLogprobs(lm, chunk_size=4, share_prompt=share_prompt)(**batch.tensors(), with_entropy=True)
        (logp * batch.completion_mask * torch.linspace(0.5, 1.5, logp.shape[1], dtype=dtype)).sum().backward()
        results[dtype, share_prompt] = (logp.detach(), entropy, {n: p.grad.clone() for n, p in lm.named_parameters()})
    shared, full, exact = results[torch.float32, True], results[torch.float32, False], results[torch.float64, False]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(shared[0][mask], full[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1][mask], full[1][mask], atol=1e-5, rtol=1e-5)
    assert_as_exact_as(shared[2], full[2], exact[2], "shared-prompt gradients")
    assert any(grad.abs().sum() > 0 for grad in shared[2].values())


def test_a_models_generation_config_extras_do_not_leak_into_sampling(tiny_model_path):
    """Checkpoints ship sampling defaults (Qwen2.5-Instruct: top_k 20, repetition_penalty 1.05). Sampling
    must follow `rollout.*` only, or the completions come from a distribution the loss does not score.
    Both engine paths (own decode loop, `generate`) draw the same tokens as with a clean config."""
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    prompt_ids = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+4?", "What is 7+75?"])
    seeds = list(range(len(prompt_ids)))

    def sample(share_prompt):
        engine = hf_engine(lm, tokenizer, 12, share_prompt)
        return engine.generate(prompt_ids, 1, seeds=seeds).completion_ids

    clean = sample(True)
    lm.generation_config.update(top_k=2, repetition_penalty=3.0, temperature=0.3, top_p=0.5, no_repeat_ngram_size=1)
    assert sample(True) == clean
    assert sample(False) == clean


def test_the_lean_llama_step_gives_the_forwards_bits_or_steps_aside(tiny_model_path, monkeypatch, caplog):
    """The decode loop's lean Llama step (rollout/llama_step.py) is compared with the forward on the model's first
    decode step and then used: the very same samples as the forward's. Where its logits would differ (made to
    here) the forward runs from then on, the cache written again: still the same samples, and one line says so.
    A forward hook anywhere, or training mode, keeps the forward (skipping `__call__` would skip the hook)."""
    from grpo_trainer.rollout import llama_step

    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+4?"])

    def sample(lm):
        torch.manual_seed(3)
        return hf_engine(lm, tokenizer, 12, True, temperature=1.3).generate(prompts, 4).completion_ids

    supports = llama_step.supports
    monkeypatch.setattr(llama_step, "supports", lambda model: False)
    forward = sample(load_causal_lm(ModelConfig()).eval())
    monkeypatch.setattr(llama_step, "supports", supports)

    steps, real_step = [], llama_step.LlamaDecodeStep.__call__
    monkeypatch.setattr(llama_step.LlamaDecodeStep, "__call__", lambda self, *a: steps.append(1) or real_step(self, *a))
    lean_lm = load_causal_lm(ModelConfig()).eval()
    assert sample(lean_lm) == forward and llama_step.checked(lean_lm) is True
    assert len(steps) >= max(map(len, forward)) - 1  # every decode step but the prefill's
    assert len({len(c) for c in forward}) > 1  # rows finished at different steps: the cache was compacted on the way

    def off_step(self, *args):  # one token made near-certain: samples through it would differ from the forward's
        logits = real_step(self, *args)
        logits[:, 5] += 50.0
        return logits

    monkeypatch.setattr(llama_step.LlamaDecodeStep, "__call__", off_step)
    off_lm = load_causal_lm(ModelConfig()).eval()
    with caplog.at_level("INFO", logger="grpo_trainer"):
        assert sample(off_lm) == forward and llama_step.checked(off_lm) is False
    assert "the lean Llama step does not give the forward's bits here" in caplog.text

    hooked = load_causal_lm(ModelConfig()).eval()
    assert supports(hooked)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert not supports(hooked) and not supports(load_causal_lm(ModelConfig()).train())


# Every alternative of the decode loop's measured choices (rollout/kernels.py), forced: each must be exact.
FORCED_KERNELS = ["linear=weight_stationary,attention=grouped", "linear=linear,attention=repeated",
                  "linear=weight_stationary,attention=grouped_matmul", "linear=onednn_packed,attention=grouped",
                  "linear=weight_stationary,attention=native"]


@pytest.mark.parametrize("kernels", FORCED_KERNELS)
@pytest.mark.parametrize("drop_row_after", [None, 1], ids=["all-rows", "a-row-finishes"])
def test_decode_loop_cache_and_attention_equal_transformers_own(tiny_model_path, drop_row_after, kernels, monkeypatch):
    """The decode loop's reserved KV room and each of its kernel alternatives (the tiny model has 4 query heads on
    2 key/value heads) give transformers' own decode logits, padding and a row leaving the batch included."""
    from helpers import decode_logits

    monkeypatch.setenv("GRPO_TRAINER_DECODE_KERNELS", kernels)

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_path)))
    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    assert lm.config.num_attention_heads > lm.config.num_key_value_heads
    prompts = [tokenizer("12+7=", add_special_tokens=False)["input_ids"], tokenizer("3*45-6=", add_special_tokens=False)["input_ids"]]
    continuations = [tokenizer("19 done", add_special_tokens=False)["input_ids"],
                     tokenizer("129 yes", add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        plain = decode_logits(lm, prompts, continuations, tokenizer.pad_token_id, False, drop_row_after)
        in_place = decode_logits(lm, prompts, continuations, tokenizer.pad_token_id, True, drop_row_after)
    assert lm.config._attn_implementation == "sdpa"  # switched back after the loop
    for a, b in zip(plain, in_place):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- stop strings


def test_stop_strings_cut_on_the_token_that_completes_them():
    """By hand, with multi-character tokens: the cut is the token in whose text the stop string ends (across
    token boundaries, or inside a token with text after it), as vLLM cuts token ids."""
    from grpo_trainer.rollout.stop import StopStrings

    vocab = ["a", "b</", "tool", "_call>", "x", "</tool_call>y", "<", "/tool_call>"]
    stop = StopStrings(["</tool_call>"], lambda ids: "".join(vocab[i] for i in ids))
    assert stop.cut([0, 1, 2, 3, 4]) == 4  # "b</" + "tool" + "_call>": the third token completes it
    assert stop.cut([0, 4, 5, 0]) == 3  # completed inside one token that carries more text
    assert stop.cut([6, 7]) == 2 and stop.cut([0] * 100 + [6, 7, 4]) == 102  # the window is long enough
    assert stop.cut([0, 1, 2, 4]) is None and stop.cut([]) is None
    assert not stop.completes_stop([6, 7, 4])  # already complete before the newest token: not new
    two = StopStrings(["x", "tool"], lambda ids: "".join(vocab[i] for i in ids))
    assert two.cut([0, 2, 4]) == 2  # the earliest of several stop strings wins
    with pytest.raises(ValueError, match="empty"):
        StopStrings([""], lambda ids: "")


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared-prompt", "full"])
def test_hf_engine_ends_completions_on_stop_strings(tiny_model_path, share_prompt):
    """rollout.stop in the hf engine: every completion ends on the token that completes its first stop string
    (the tiny model writes "7+5=\\boxed{12}" or "\\boxed{9}": "=" and the three-token "xed" both occur), and one
    that stopped so is not truncated. tests/test_vllm.py holds vLLM to the same rule."""
    from helpers import assert_stopped_where_vllm_stops

    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    prompt_ids = _chat_prompts(tokenizer, ["What is 1+2?", "What is 3+4?", "What is 5+5?"])
    stop = ["=", "xed"]
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=16, stop=tuple(stop))
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id)
    engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id, share_prompt=share_prompt,
                      tokenizer=tokenizer)
    torch.manual_seed(0)
    rollout = engine.generate(prompt_ids, 8)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    stopped = [assert_stopped_where_vllm_stops(decode, c, t, stop, tokenizer.eos_token_id, 16)
               for c, t in zip(rollout.completion_ids, rollout.truncated)]
    ends = {decode(c)[-3:] for c, s in zip(rollout.completion_ids, stopped) if s}
    assert any(e.endswith("=") for e in ends) and "xed" in ends  # both stop strings fired


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-statistic", "entropy-in-the-loss"])
def test_a_training_pass_keeps_no_vocabulary_sized_tensor_and_its_gradients_are_unchanged(tiny_model_path, entropy_grad,
                                                                                          monkeypatch):
    """Scoring under activation checkpointing (models.TokenLogprobs._score): autograd saves no [B, c, V] tensor
    for the backward pass (the chunk's logits are computed again there), and log-probs, entropies and every
    gradient are bit for bit those of keeping the logits. Three chunks of positions here (chunk_size 3)."""
    from grpo_trainer import models

    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?"])
    completions = [[5, 9, 11, 3, 7, 8, 21], [4, 4, 30], [12, 13, 14, 15, 16, 17, 18, 19]]
    batch = make_sequence_batch([prompts[0], prompts[0], prompts[1]], completions, tokenizer.pad_token_id)

    def scored(lm):
        lm.zero_grad(set_to_none=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            logp, entropy = TokenLogprobs(lm, chunk_size=3)(**batch.tensors(), with_entropy=True, entropy_grad=entropy_grad)
        loss = (logp * batch.completion_mask).sum() + (entropy * batch.completion_mask).sum() * entropy_grad
        loss.backward()
        return saved, (logp.detach(), entropy.detach(), {n: p.grad for n, p in lm.named_parameters()})

    lm = load_causal_lm(ModelConfig()).train()
    vocab = lm.config.vocab_size
    saved, got = scored(lm)
    assert not [shape for shape in saved if shape[-1] == vocab and len(shape) == 3]
    monkeypatch.setattr(models, "checkpoint", lambda fn, *args, **kwargs: fn(*args))  # keep the logits instead
    kept, want = scored(lm)
    assert [shape for shape in kept if shape[-1] == vocab and len(shape) == 3]  # what the checkpointing avoids
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: torch.equal holds -0.0 and +0.0 equal, these do not."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_log_prob_backward_gives_autograds_gradients_bit_for_bit_without_vocabulary_sized_allocations(
        dtype, temperature, monkeypatch):
    """cpu/lm_head.TargetLogprobs against the plain autograd expression it replaces: the same log-probs and entropies,
    and bit for bit the same gradients (signs of zero included) for the logits, the hidden states and the output
    head, with the backward's one-hot rows built a few at a time (3 blocks here); the plain expression allocates
    [B, c, V] tensors in the forward (the division, the log-softmax, the entropy's two) and in the backward
    (one-hot, log-softmax gradient, the division's), this one the log-softmax only (and the division at T != 1)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo_trainer.cpu import lm_head

    class VocabularySizedAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.vocabulary_sized = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs_of(args):
                    self.vocabulary_sized += t.numel() == rows * positions * vocab and t.dtype == torch.float32
            return out

    def inputs_of(args):
        return {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

    rows, positions, vocab, width = 3, 7, 50, 16
    monkeypatch.setattr(lm_head.TargetLogprobs, "BLOCK_BYTES", 8 * vocab * 4)  # 8 of the 21 positions per block
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False).to(dtype)
    hidden = torch.randn(rows, positions, width, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, positions))
    upstream = torch.randn(rows, positions)
    upstream[0, :3] = -0.0  # masked positions of a negative advantage: autograd's gradient there is +0.0

    def run(score, keep_logits_grad=False):  # keeping the logits' gradient costs a [B, c, V] copy of its own
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        logits = head(hidden).float()
        if keep_logits_grad:
            logits.retain_grad()
        forward = VocabularySizedAllocations()
        with forward:
            logp, entropy = score(logits)
        backward = VocabularySizedAllocations()
        with backward:
            logp.backward(upstream)
        return (logp.detach(), entropy, logits.grad if keep_logits_grad else None, hidden.grad, head.weight.grad,
                (forward.vocabulary_sized, backward.vocabulary_sized))

    def plain(logits):
        logp_all = (logits / temperature).log_softmax(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
        return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy

    ours = lambda logits: lm_head.TargetLogprobs.apply(logits, targets, temperature, True)  # noqa: E731
    *got, got_allocated = run(ours)
    *want, want_allocated = run(plain)
    assert all(same_bits(a, b) for a, b in zip(got, want) if a is not None)
    assert same_bits(run(ours, keep_logits_grad=True)[2], run(plain, keep_logits_grad=True)[2])
    # float32 [B, c, V] tensors allocated (a bfloat16 head's gradient is a bfloat16 copy in both): the forward's
    # log-softmax (and the logits / T where T != 1), nothing in the backward
    assert got_allocated == (1 + (temperature != 1), 0)
    assert want_allocated[0] == 4 and want_allocated[1] >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["shared_prompt", "full", "chunked", "packed"])
def test_a_tied_heads_gradient_is_autograds_bit_for_bit_and_summed_in_place(tiny_model_path, dtype, layout,
                                                                            monkeypatch):
    """cpu/lm_head.TiedHead (the tiny model ties its head to the input embeddings): log-probs and every gradient bit for
    bit what the head module called through autograd gives, and the tied weight's gradient is the very tensor the
    head's backward made, the embedding lookups' gradients added into it in place (autograd's own head gradient
    is a view it adds out of place: a third vocabulary-sized tensor at the end of SmolLM2's backward). In every
    layout: the shared prompt's two decoder passes, full sequences, chunks of 2 positions (each recomputed in the
    backward: the head's later chunks add into the first's gradient) and packed rows."""
    from grpo_trainer.cpu import lm_head

    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?"])
    rows = [prompts[0], prompts[0], prompts[1]], [[5, 7, 9], [4], [12, 3]]
    batch = (make_packed_batch if layout == "packed" else make_sequence_batch)(*rows, tokenizer.pad_token_id)
    lm = load_causal_lm(ModelConfig()).to(dtype).train()
    weight = lm.get_input_embeddings().weight
    assert lm.get_output_embeddings().weight is weight
    made = []  # where the head's backward put the weight's gradient (the address only: a reference would block
    backward = lm_head.TiedHead.backward  # autograd's in-place add, which needs the last one)

    def recorded(ctx, grad):
        grads = backward(ctx, grad)
        made.append(grads[1].data_ptr())
        return grads

    monkeypatch.setattr(lm_head.TiedHead, "backward", staticmethod(recorded))

    def scored(tied: bool):
        lm.zero_grad(set_to_none=True)
        scorer = TokenLogprobs(lm, share_prompt=layout != "full", chunk_size=2 if layout == "chunked" else None)
        if not tied:
            scorer._logits = lambda head, hidden: head(hidden)
        logp, _ = scorer(**batch.tensors())
        (logp * batch.completion_mask).sum().backward()
        return logp.detach(), [p.grad for p in lm.parameters()]

    (got, got_grads), (want, want_grads) = scored(tied=True), scored(tied=False)
    assert len(made) == (2 if layout == "chunked" else 1)  # the tied path ran once a chunk, the plain one not at all
    assert same_bits(got, want) and all(same_bits(a, b) for a, b in zip(got_grads, want_grads))
    assert got_grads[0] is not None and got_grads[0].data_ptr() in made
    if dtype == torch.float32:  # under autocast (mixed precision) the head is called as it is: casts and all
        calls = len(made)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_logp, autocast_grads = scored(tied=True)
        assert len(made) == calls and autocast_logp.dtype == torch.float32 and autocast_grads[0].dtype == torch.float32


def test_ranks_in_lockstep_run_the_completion_pass_even_for_one_position(tiny_model_path):
    """The shared-prompt layout skips its second decoder pass when the completions are one token wide, but not
    where ranks must call every module equally often (`agree_chunks` set: ZeRO-3, FSDP), since another rank's
    completions may be longer: there it runs on that token and changes nothing, log-probs and gradients bit for bit."""
    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?"])
    batch = make_sequence_batch([prompts[0], prompts[0], prompts[1]], [[5], [4], [12]], tokenizer.pad_token_id)
    lm = load_causal_lm(ModelConfig()).train()
    decoder = lm.get_decoder()

    def scored(agree):
        lm.zero_grad(set_to_none=True)
        passes = []
        hook = decoder.register_forward_hook(lambda module, args, kwargs, out: passes.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
        try:
            logp, _ = TokenLogprobs(lm, agree_chunks=agree)(**batch.tensors())
            (logp * batch.completion_mask).sum().backward()
        finally:
            hook.remove()
        return passes, logp.detach(), [p.grad for p in lm.parameters()]

    alone, lockstep = scored(None), scored(lambda chunks: chunks)
    assert len(alone[0]) == 1 and len(lockstep[0]) == 2 and lockstep[0][1] == 1  # prompts; then the one token
    assert same_bits(alone[1], lockstep[1]) and all(same_bits(a, b) for a, b in zip(alone[2], lockstep[2]))


def test_unset_chunk_size_keeps_a_chunks_logits_within_256_mib():
    lm = torch.nn.Module()
    lm.config = type("Config", (), {"vocab_size": 49152})()
    scorer = TokenLogprobs(lm)
    assert scorer._positions_per_chunk(16) == 256 * 2**20 // (4 * 49152 * 16) == 85
    assert scorer._positions_per_chunk(100_000) == 1
    assert TokenLogprobs(lm, chunk_size=5)._positions_per_chunk(16) == 5


def test_where_module_calls_are_collective_the_ranks_agree_on_their_chunk_count():
    """Under ZeRO-3 and multi-process FSDP each output-head call gathers its weights across ranks, and a rank's
    chunk count follows its own completion lengths: the ranks agree on the largest (run.chunk_agreement: an
    all-reduce max there, nothing under DDP or one process)."""
    from types import SimpleNamespace

    from grpo_trainer.run import chunk_agreement

    def accelerator(processes, kind, zero=None):
        plugin = None if zero is None else SimpleNamespace(zero_stage=zero)
        return SimpleNamespace(num_processes=processes, process_index=0, distributed_type=SimpleNamespace(value=kind),
                               state=SimpleNamespace(deepspeed_plugin=plugin), device="cpu",
                               reduce=lambda t, op: t * 3 if op == "max" else None)  # another rank needs 3x as many

    for sharded in (accelerator(2, "DEEPSPEED", zero=3), accelerator(2, "FSDP")):
        assert chunk_agreement(sharded)(2) == 6
    for plain in (accelerator(2, "DEEPSPEED", zero=2), accelerator(2, "MULTI_CPU"), accelerator(1, "FSDP")):
        assert chunk_agreement(plain) is None


@pytest.mark.parametrize("grad", [False, True], ids=["log-prob-pass", "training-pass"])
def test_a_rank_with_fewer_chunks_calls_the_head_as_often_as_agreed_and_scores_the_same(tiny_model_path, grad):
    """With `agree_chunks` asking for more chunks than this rank's completions need, the output head is called
    that often in the forward (and, recomputed, in the backward), the extra calls on empty chunks; log-probs,
    entropies and gradients are those of the rank's own chunking."""
    tokenizer = load_tokenizer(ModelConfig())
    prompts = _chat_prompts(tokenizer, ["What is 1+2?", "What is 13+40?"])
    completions = [[5, 9, 11, 3, 7], [4, 4, 30], [12, 13, 14, 15]]
    batch = make_sequence_batch([prompts[0], prompts[0], prompts[1]], completions, tokenizer.pad_token_id)
    lm = load_causal_lm(ModelConfig()).train()
    head = lm.get_output_embeddings()

    def scored(agree):
        lm.zero_grad(set_to_none=True)
        calls = []
        hook = head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
        try:
            with torch.set_grad_enabled(grad):
                logp, entropy = TokenLogprobs(lm, chunk_size=2, agree_chunks=agree)(**batch.tensors(), with_entropy=True)
            if grad:
                (logp * batch.completion_mask).sum().backward()
        finally:
            hook.remove()
        return calls, (logp.detach(), entropy, {n: p.grad for n, p in lm.named_parameters()})

    own_calls, own = scored(None)
    agreed_calls, agreed = scored(lambda chunks: chunks + 2)  # another rank has two chunks more
    # 5 positions in chunks of 2; a training pass computes them again in its backward, last chunk first
    assert own_calls == [2, 2, 1] + [1, 2, 2] * grad
    assert agreed_calls == [2, 2, 1, 0, 0] + [0, 0, 1, 2, 2] * grad
    assert torch.equal(own[0], agreed[0]) and torch.equal(own[1], agreed[1])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(own[2].values(), agreed[2].values()))
