"""The decode loop's measured kernel choices (rollout/kernels.py, decode.py, cpu/draw.py, cpu/linear.py): every
alternative exact, the choice cached per machine and shape, forced choices honoured, measurement only where it
can matter, and only while a run is planned: the loop looks its choices up and never times anything."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_trainer.cpu import attention, layer_ops
from grpo_trainer.cpu import draw as draws
from grpo_trainer.cpu.linear import LINEAR, available_linears
from grpo_trainer.cpu.machine import cpu_info
from grpo_trainer.rollout import kernels
from grpo_trainer.rollout.decode import ATTENTION, DecodeKernels, plan_key


def _stream_at(seed: int, offset: int) -> None:
    torch.manual_seed(seed)
    torch.rand(offset)  # start anywhere in the twister's 624-word block


@pytest.mark.parametrize("name", ["numpy", "native"])
def test_every_draw_gives_torch_multinomials_tokens_and_generator_state(name):
    """Same seed, same tokens as torch.multinomial(probs, 1), and the generator left where multinomial leaves it,
    so the next draw (and `generate`'s tokens per seed) is unchanged too. Peaked, flat, sparse rows included."""
    if name not in draws.available_draws():
        pytest.skip(f"the {name} draw is not available here (no working C compiler)")
    for seed in range(24):
        vocab = 49152 if seed % 2 else 97
        logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(seed)) * (2, 6, 30)[seed % 3]
        if seed % 4 == 3:
            logits[:, vocab // 2 :] = -float("inf")  # zero probabilities, as top-k/top-p leave them
        probs = logits.softmax(-1)
        _stream_at(seed, 37 * seed)
        expected = torch.multinomial(probs, 1).squeeze(1)
        state = torch.get_rng_state()
        _stream_at(seed, 37 * seed)
        assert torch.equal(draws.DRAWS[name](probs), expected), f"seed {seed}"
        assert torch.equal(torch.get_rng_state(), state), f"seed {seed}: generator state differs"


def test_the_draws_fall_back_to_torch_where_they_cannot_emulate_it():
    probs = torch.tensor([[0.25, 0.75]], dtype=torch.float64)  # not float32: torch's own draw
    for draw in draws.DRAWS.values():
        torch.manual_seed(0)
        expected = torch.multinomial(probs, 1).squeeze(1)
        torch.manual_seed(0)
        assert torch.equal(draw(probs), expected)


def test_without_a_c_compiler_the_native_draw_is_simply_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("GRPO_TRAINER_CACHE", str(tmp_path))
    draws.native_library.cache_clear()
    try:
        assert draws.native_library() is None and "native" not in draws.available_draws()
        probs = torch.tensor([[0.5, 0.5]])
        torch.manual_seed(3)
        expected = torch.multinomial(probs, 1).squeeze(1)
        torch.manual_seed(3)
        assert torch.equal(draws.draw_native(probs), expected)
    finally:
        draws.native_library.cache_clear()


# ----------------------------------------------------------------------------- the table


def _counting(timings: dict[str, float]):
    """A measure() whose calls are counted; the timed functions sleep nothing, the table sees `timings`."""
    calls = []

    def measure():
        calls.append(1)
        return {name: (lambda: None) for name in timings}

    return measure, calls


def test_a_choice_is_measured_once_per_machine_and_shape_then_read_from_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "decode_kernels.json"
    fake = {"a": 2.0, "b": 1.0}
    monkeypatch.setattr(kernels, "time_alternatives", lambda candidates, **_: {k: fake[k] for k in candidates})
    measure, calls = _counting(fake)
    assert kernels.KernelTable(path).decide("linear", (8, 4, 16), ["a", "b"], measure, worth_measuring=True) == "b"
    assert len(calls) == 1
    entry = next(iter(json.loads(path.read_text())["choices"].values()))
    assert entry["choice"] == "b" and entry["ms"] == fake and "loadavg" in entry
    assert entry["machine"]["cpu"] == cpu_info()["model"] and entry["machine"]["torch"] == torch.__version__
    # A new process (a fresh table on the same file) reuses it; another shape is measured on its own.
    fresh = kernels.KernelTable(path)
    assert fresh.decide("linear", (8, 4, 16), ["a", "b"], measure, worth_measuring=True) == "b"
    assert len(calls) == 1
    fresh.decide("linear", (8, 4, 8), ["a", "b"], measure, worth_measuring=True)
    assert len(calls) == 2 and len(json.loads(path.read_text())["choices"]) == 2
    # An alternative added since (a new kernel, a newer torch offering one) is measured, not passed over.
    fake["c"] = 0.5
    assert kernels.KernelTable(path).decide("linear", (8, 4, 16), ["a", "b", "c"], measure, worth_measuring=True) == "c"
    assert len(calls) == 3


def test_the_incumbent_stays_unless_measurement_matters_and_the_gain_is_clear(tmp_path, monkeypatch):
    timings = {}
    monkeypatch.setattr(kernels, "time_alternatives", lambda candidates, **_: dict(timings))
    table = kernels.KernelTable(None)
    measure, calls = _counting({"old": 0, "new": 0})
    timings.update(old=1.0, new=0.1)
    assert table.decide("x", (1,), ["old", "new"], measure, worth_measuring=False) == "old"  # too small to matter
    assert calls == []
    timings.update(old=1.0, new=0.95)  # 5% is within noise: keep what runs today
    assert table.decide("x", (2,), ["old", "new"], measure, worth_measuring=True) == "old"
    timings.update(old=1.0, new=0.8)
    assert table.decide("x", (3,), ["old", "new"], measure, worth_measuring=True) == "new"


def test_forced_choices_win_and_a_wrong_name_is_an_error_naming_the_choices(monkeypatch):
    table = kernels.KernelTable(None)
    measure, calls = _counting({"a": 1, "b": 1})
    monkeypatch.setenv(kernels.FORCE_ENV, "linear=b, draw=torch")
    assert table.decide("linear", (1,), ["a", "b"], measure, worth_measuring=True) == "b" and calls == []
    monkeypatch.setenv(kernels.FORCE_ENV, "linear=c")
    with pytest.raises(ValueError, match=r"linear='c' is not available here; choose from \['a', 'b'\]"):
        table.decide("linear", (1,), ["a", "b"], measure, worth_measuring=True)
    monkeypatch.setenv(kernels.FORCE_ENV, "linear")
    with pytest.raises(ValueError, match="is not decision=alternative"):
        table.decide("linear", (1,), ["a", "b"], measure, worth_measuring=True)


def test_timing_alternates_and_leaves_the_random_stream_alone():
    order = []
    torch.manual_seed(0)
    state = torch.get_rng_state()
    ms = kernels.time_alternatives({"a": lambda: order.append("a") or torch.rand(3),
                                    "b": lambda: order.append("b") or torch.rand(3)}, reps=4)
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    assert order[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # after one warm-up call each, each goes first in turn
    assert torch.equal(torch.get_rng_state(), state)


def test_buckets():
    assert [kernels.row_bucket(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    assert [kernels.length_bucket(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]


# ----------------------------------------------------------------------------- the kernels themselves


@pytest.mark.parametrize("form", sorted(LINEAR))
def test_every_linear_form_computes_nn_linear(form):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)  # with a bias, unlike the Llama layers
    for rows in ((3, 1, 24), (5, 24), (1, 1, 24)):
        x = torch.randn(*rows)
        out = LINEAR[form](layer, x)
        torch.testing.assert_close(out, layer(x), atol=1e-6, rtol=1e-6)
        assert out.is_contiguous()  # a transposed output sent the next attention down SDPA's slow path


@pytest.mark.skipif("onednn_packed" not in available_linears(torch.float32), reason="this torch has no oneDNN")
def test_the_packed_form_follows_the_weights_and_is_dropped_when_the_loop_ends(tiny_model_path, monkeypatch):
    """The reordered weights are reused while the weights are unchanged, made again after an in-place update
    (an optimizer step between two rollouts), and gone from every module when the decode loop ends."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm
    from grpo_trainer.cpu.linear import PACKED

    monkeypatch.setenv(kernels.FORCE_ENV, "linear=onednn_packed")
    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    layer = next(m for m in lm.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(4, 1, layer.in_features)
    with torch.no_grad(), DecodeKernels(lm):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
        packed = vars(layer)[PACKED]
        layer(x)
        assert vars(layer)[PACKED] is packed
        layer.weight.mul_(-2.0)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
        assert vars(layer)[PACKED] is not packed
    assert not any(PACKED in vars(m) for m in lm.modules())


@pytest.mark.parametrize("path", sorted(ATTENTION))
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding"])
def test_every_attention_path_computes_grouped_query_attention(path, masked):
    """query [B, 6, 1, D] on key/value [B, 2, L, D]: each path equals the textbook computation (heads repeated)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g)
    mask = None
    if masked:
        mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
        mask[0, ..., :2] = False
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    scores = q @ kr.transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, -float("inf"))
    expected = scores.softmax(-1) @ vr
    torch.testing.assert_close(ATTENTION[path](q, k, v, mask, None), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(attention.attention_library() is None, reason="no C compiler here: the native attention is not offered")
def test_the_native_attention_is_exact_to_float32_on_a_cache_with_room_and_the_same_on_any_thread_count():
    """SmolLM2's shapes (9 query heads on 3 key/value heads, 64 dims), keys and values in a buffer with room (as the
    decode loop's cache), left padding: within float32 rounding of float64 SDPA, and bit for bit the same output on
    one thread and on two (each (row, head) pair is one thread's work)."""
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(7, 3, 90, 64, generator=g), torch.randn(7, 3, 90, 64, generator=g)
    key, value, query = keys[:, :, :71], values[:, :, :71], torch.randn(7, 9, 1, 64, generator=g) * 2
    mask = torch.ones(7, 1, 1, 71, dtype=torch.bool)
    mask[2, ..., :30] = False
    assert attention.runs(query, key, value, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double().reshape(7, 3, 3, 64), key.double(), value.double(), attn_mask=mask
    ).reshape(7, 9, 1, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention.native_attention(query, key, value, mask, None)
        torch.set_num_threads(2)
        two = attention.native_attention(query, key, value, mask, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), expected, atol=2e-6, rtol=1e-5)
    # What it does not take, the decode loop's `native` path hands to grouped SDPA: other dtypes, a float mask.
    assert not attention.runs(query.bfloat16(), key.bfloat16(), value.bfloat16(), mask)
    assert not attention.runs(query, key, value, torch.zeros(7, 1, 1, 71))
    half = ATTENTION["native"](query.double(), key.double(), value.double(), mask, None)
    assert torch.equal(half, ATTENTION["grouped"](query.double(), key.double(), value.double(), mask, None))


def test_the_rule_gives_the_native_attention_where_a_step_reads_enough_cache(tiny_model_path):
    """By rule, never timed: `native` where a decode step reads at least MIN_WORK_BYTES of keys and values at that
    shape (and it builds here), grouped SDPA below."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm

    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    loop = DecodeKernels(lm)
    big, small = (128, 4, 2, 4096, 24), (16, 4, 2, 256, 24)  # 2 layers: 384 MiB and 3 MiB a step
    native = "native" if attention.attention_library() is not None else "grouped"
    assert loop.decide("attention", big, kernels.KernelTable(None)) == native
    assert loop.decide("attention", small, kernels.KernelTable(None)) == "grouped"


def test_decode_kernels_put_their_choices_in_place_and_restore_the_model(tiny_model_path):
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm

    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    linears = [m for m in lm.modules() if type(m) is torch.nn.Linear]
    with DecodeKernels(lm) as chosen:
        assert all("forward" in vars(m) for m in linears) and lm.config._attn_implementation != "sdpa"
        x = torch.randn(4, 1, lm.config.hidden_size)
        torch.testing.assert_close(linears[0](x), torch.nn.functional.linear(x, linears[0].weight), atol=1e-6, rtol=1e-6)
        assert chosen.chosen == {f"linear/{linears[0].weight.shape[0]}x{lm.config.hidden_size}x4": "weight_stationary"}
    assert not any("forward" in vars(m) for m in linears) and lm.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), DecodeKernels(lm):
        raise RuntimeError("a failure inside the loop")
    assert not any("forward" in vars(m) for m in linears) and lm.config._attn_implementation == "sdpa"


def test_small_models_keep_todays_kernels_without_measuring(tiny_model_path, monkeypatch):
    """The tiny model's linears and cache are far below what is worth timing: incumbents, nothing measured,
    so the demo (and the golden test) runs the same kernels on every machine."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm
    from grpo_trainer.rollout.decode import plan_decode_kernels

    monkeypatch.setattr(kernels, "time_alternatives", lambda *a, **k: pytest.fail("measured a tiny kernel"))
    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    plan = plan_decode_kernels(lm, 128, 60, kernels.KernelTable(None))  # the demo's reach: 16 prompts x 8
    assert plan and {name for name in plan.values()} <= {"weight_stationary", "grouped", "torch", "modules"}
    chosen = DecodeKernels(lm, plan)
    module = next(m for m in lm.modules() if type(m) is torch.nn.Linear)
    assert chosen.linear_form(module, 128) is LINEAR["weight_stationary"]
    q = torch.randn(128, lm.config.num_attention_heads, 1, 24)
    k = torch.randn(128, lm.config.num_key_value_heads, 48, 24)
    assert chosen.attention_path(q, k, None) is ATTENTION["grouped"]


@pytest.mark.parametrize("draw", sorted(draws.DRAWS))
def test_the_engine_samples_generates_tokens_with_every_draw(tiny_model_path, draw, monkeypatch):
    """End to end: with each draw forced, the decode loop gives `generate`'s tokens for the same seeds."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm, load_tokenizer
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.hf import HFEngine

    if draw not in draws.available_draws():
        pytest.skip(f"the {draw} draw is not available here")
    monkeypatch.setenv(kernels.FORCE_ENV, f"draw={draw}")
    tokenizer, lm = load_tokenizer(ModelConfig()), load_causal_lm(ModelConfig())
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}],
                                                       add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for a, b in ((1, 2), (13, 4), (7, 75))]
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=12, temperature=1.2)
    out = {share: HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id, share_prompt=share)
           .generate(prompts, 1, seeds=[5, 6, 7]).completion_ids for share in (True, False)}
    assert out[True] == out[False]


def test_a_cached_choice_is_final_until_remeasured_explicitly(tmp_path, monkeypatch):
    """Nothing re-times a cached choice behind the user's back (not even one timed on a busy machine, once it is
    quiet: that would change what later runs sample); `remeasure` (the `kernels --remeasure` command) does."""
    path = tmp_path / "decode_kernels.json"
    monkeypatch.setattr(kernels.os, "cpu_count", lambda: 2)
    timings = {"a": 2.0, "b": 1.0}
    monkeypatch.setattr(kernels, "time_alternatives", lambda candidates, **_: dict(timings))
    measure, calls = _counting({"a": 0, "b": 0})
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert kernels.KernelTable(path).decide("linear", (1,), ["a", "b"], measure, worth_measuring=True) == "b"
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (0.3, 0.5, 1.0))
    timings.update(a=1.0, b=2.0)
    assert kernels.KernelTable(path).decide("linear", (1,), ["a", "b"], measure, worth_measuring=True) == "b"
    assert len(calls) == 1
    assert kernels.KernelTable(path).decide("linear", (1,), ["a", "b"], measure, worth_measuring=True, remeasure=True) == "a"
    assert len(calls) == 2 and next(iter(json.loads(path.read_text())["choices"].values()))["choice"] == "a"


def test_measuring_leaves_the_global_random_stream_alone(tmp_path):
    """measure() itself (which builds the timed inputs) runs with the random state saved and restored: a run that
    measures must sample what a run on a warm cache samples."""
    torch.manual_seed(0)
    state = torch.get_rng_state()

    def measure():
        torch.rand(1000)  # as the old linear measurement drew its input from the global generator
        return {"a": lambda: torch.rand(3), "b": lambda: torch.rand(3)}

    kernels.KernelTable(None).decide("linear", (1,), ["a", "b"], measure, worth_measuring=True)
    assert torch.equal(torch.get_rng_state(), state)


def _decode_through(lm, plan: dict[str, str], steps: int = 6, keep_after: int = 3, rows: int = 4, room: int = 0):
    """Prefill a left-padded batch of `rows` rows (4: two of them padded), then `steps` decode steps through
    EagerDecoder under `plan` (greedy tokens; with 4 rows, rows 0 and 2 kept after `keep_after` steps, as finished
    rows leave) in a cache with room for `room or steps` tokens; (logits per step, decoder)."""
    from grpo_trainer.rollout.decode import EagerDecoder, reserve_room

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (rows, 9), generator=g)
    mask = torch.ones(rows, 9, dtype=torch.long)
    if rows == 4:
        mask[1, :4], mask[3, :7] = 0, 0
    else:
        keep_after = steps  # nothing to drop
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        reserve_room(cache, room or steps)
        with DecodeKernels(lm, plan) as loop:
            decoder = EagerDecoder(lm, cache, mask, loop)
            tokens, positions, logits = out.logits[:, -1].argmax(-1), mask.sum(-1), []
            for step in range(steps):
                if step == keep_after:
                    keep = torch.tensor([0, 2])
                    decoder.keep(keep)
                    tokens, positions = tokens[keep], positions[keep]
                logits.append(decoder.forward(tokens, positions))
                tokens, positions = logits[-1].argmax(-1), positions + 1
    return logits, decoder


@pytest.mark.skipif(layer_ops.layer_library() is None, reason="no C compiler here: the fused step is not offered")
def test_the_fused_step_is_within_float32_of_the_forward_and_the_same_on_any_thread_count(tiny_model_path):
    """The fused Llama step (rollout/llama_step.py, cpu/layer_ops.py: residual + RMSNorm, rotary + cache write +
    attention, SiLU x up in C) against the model's own forward, on a left-padded batch whose rows are compacted
    midway: logits within float32 rounding at every step (greedy tokens the same), and bit for bit the same on one
    thread and on two (each row is one thread's work)."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm

    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    step_key = plan_key("step", DecodeKernels(lm).step_shape)
    expected, modules = _decode_through(lm, {step_key: "modules"})
    assert modules.fused is None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, fused = _decode_through(lm, {step_key: "fused"})
        torch.set_num_threads(2)
        two, _ = _decode_through(lm, {step_key: "fused"})
    finally:
        torch.set_num_threads(threads)
    assert fused.fused is not None
    for step, (got, want, again) in enumerate(zip(one, expected, two)):
        assert torch.equal(got, again), f"step {step}: the thread count changed the bits"
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=0, msg=f"step {step}")
        assert not torch.equal(got, want) or step == 0  # it is another kernel (the first step may round alike)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # What the fused step wrote into the cache is the forward's keys and values (rotated the same way)
    fused_cache, forward_cache = fused.cache.layers, modules.cache.layers
    for mine, theirs in zip(fused_cache, forward_cache):
        assert mine.get_seq_length() == theirs.get_seq_length() == 9 + 6
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(layer_ops.layer_library() is None, reason="no C compiler here: the fused step is not offered")
def test_the_fused_step_is_chosen_by_rule_and_steps_aside_where_it_cannot_run(tiny_model_path, monkeypatch, caplog):
    """By rule, never timed: `fused` for a plain float32 Llama whose linears read at least MIN_WORK_BYTES a step,
    the modules below (the tiny models: their golden runs unchanged). Planned but not runnable on this loop (a
    forward hook, training mode, bfloat16): the modules run, and one line says so once per model."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm

    lm = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    loop = DecodeKernels(lm)
    shape = loop.step_shape
    assert loop.decide("step", shape, kernels.KernelTable(None)) == "modules"
    monkeypatch.setattr(kernels, "MIN_WORK_BYTES", 0)
    assert loop.decide("step", shape, kernels.KernelTable(None)) == "fused"
    plan = {plan_key("step", shape): "fused"}

    def fused_runs(model) -> bool:
        return _decode_through(model, plan, steps=2, keep_after=5)[1].fused is not None

    hooked = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    training = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).train()
    bf16 = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval().to(torch.bfloat16)
    with caplog.at_level("INFO", logger="grpo_trainer"):
        assert fused_runs(lm)
        for model in (hooked, training, bf16):
            assert not fused_runs(model) and not fused_runs(model)
    refusals = [r for r in caplog.records if "the plan's fused Llama step cannot run" in r.getMessage()]
    assert len(refusals) == 3  # one line per model, not per batch


def _random_llama(**config) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**shape, **config})).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip


@pytest.mark.skipif(layer_ops.layer_library() is None, reason="no C compiler here: the fused step is not offered")
@pytest.mark.parametrize(
    "config",
    [
        dict(num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE),
        dict(num_key_value_heads=4),  # no grouping: one query head per key/value head
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=6),  # 4 heads a group, a head narrower than 16
    ],
    ids=["bias-llama3-rope-head-wider-than-hidden", "no-groups", "four-per-group"],
)
@pytest.mark.parametrize("rows", [1, 4])
def test_the_fused_step_follows_the_forward_on_other_llama_shapes(config, rows):
    """Biases, llama3 rope scaling, a head_dim other than hidden/heads, 1 to 4 query heads per key/value head, one
    row or several: the fused step's logits stay within float32 rounding of the forward's, step after step."""
    lm = _random_llama(**config)
    step_key = plan_key("step", DecodeKernels(lm).step_shape)
    expected, _ = _decode_through(lm, {step_key: "modules"}, rows=rows)
    got, fused = _decode_through(lm, {step_key: "fused"}, rows=rows)
    assert fused.fused is not None
    for step, (mine, theirs) in enumerate(zip(got, expected)):
        torch.testing.assert_close(mine, theirs, atol=2e-5 * theirs.abs().max().item(), rtol=0, msg=f"step {step}")


@pytest.mark.skipif(layer_ops.layer_library() is None, reason="no C compiler here: the fused step is not offered")
def test_the_fused_step_refuses_what_it_would_silently_skip_and_stops_at_the_caches_room():
    """It computes RMSNorm, rotary, SiLU and attention itself, so a model where any of those modules was replaced or
    wrapped (a different class, a `forward` set on the instance as accelerate's hooks do, partial rotary, autocast)
    keeps its modules; and a step past the cache's reserved room raises, as the modules' own step does."""
    from grpo_trainer.rollout.llama_step import FusedLlamaDecodeStep

    assert FusedLlamaDecodeStep.fits(_random_llama())

    class OtherNorm(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

        def forward(self, x):
            return x

    replaced = _random_llama()
    replaced.model.layers[1].post_attention_layernorm = OtherNorm(replaced.model.layers[1].post_attention_layernorm)
    overridden = _random_llama()
    overridden.model.layers[0].self_attn.forward = lambda *args, **kwargs: None
    gelu = _random_llama(hidden_act="gelu")
    partial = _random_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    for model in (replaced, overridden, gelu, partial):
        assert not FusedLlamaDecodeStep.fits(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not FusedLlamaDecodeStep.fits(_random_llama())

    lm = _random_llama()
    with pytest.raises(RuntimeError, match="KV cache room exhausted"):
        _decode_through(lm, {plan_key("step", DecodeKernels(lm).step_shape): "fused"}, steps=3, room=2)

    # The kernels trust their pointers, so their wrappers refuse what does not fit before any C runs
    ops, cache = layer_ops.layer_ops(), torch.zeros(2, 1, 5, 4)
    with pytest.raises(ValueError, match="rotate_store_attend"):  # cos/sin narrower than the head
        ops.rotate_store_attend(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 2),
                                torch.zeros(2, 2), 2, cache, cache.clone(), 1, None, 0.5)  # fmt: skip
    with pytest.raises(ValueError, match="rotate_store_attend"):  # past the room
        ops.rotate_store_attend(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4),
                                torch.zeros(2, 4), 2, cache, cache.clone(), 5, None, 0.5)  # fmt: skip
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4), 1e-5)
