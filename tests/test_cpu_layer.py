"""The CPU speed layer (grpo_trainer/cpu/): every private torch detail it relies on is as expected (a torch upgrade
that changes one fails here, with the line naming it), each check notices the change it guards against, and
where a fast path cannot run the plain one does: warned once, recorded in the run, the same numbers."""

from __future__ import annotations

import importlib
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer.cpu import draw, lm_head, paths, torch_internals
from grpo_trainer.cpu.adamw import BlockwiseAdamW, adamw_for
from grpo_trainer.cpu.linear import available_linears
from grpo_trainer.errors import ConfigError
from helpers import assert_same_run, run_cli, small_run_overrides


@pytest.fixture(autouse=True)
def fresh_decisions():
    """Each test decides (and warns) afresh, and leaves no decision made under its patches to later tests."""
    paths.why_not.cache_clear()
    yield
    paths.why_not.cache_clear()


def _fail_check(monkeypatch, detail: str, reason: str = "changed in this torch") -> None:
    monkeypatch.setitem(torch_internals.CHECKS, detail, lambda: reason)
    paths.why_not.cache_clear()


# ----------------------------------------------------------------------------- the guards


@pytest.mark.parametrize("detail", sorted(torch_internals.CHECKS))
def test_every_torch_detail_the_cpu_layer_relies_on_is_as_expected(detail):
    problem = torch_internals.CHECKS[detail]()
    assert problem is None, f"torch {torch.__version__} changed a detail the CPU layer relies on: {problem}"


def _grow_state(monkeypatch):
    real = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", lambda: torch.cat([real(), torch.zeros(8, dtype=torch.uint8)]))


def _moved_words(monkeypatch):
    monkeypatch.setattr(torch_internals, "_KEY", torch_internals._KEY + 8)


def _init_group_gone(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "_init_group", None)  # inherited from Adam: shadowed, not deleted


def _init_group_takes_more(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "_init_group", lambda self, group, a, b, c, d, e, f, g: False)


def _init_group_without_state(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "_init_group", lambda self, group, a, b, c, d, e, f: False)


def _adam_arithmetic_changed(monkeypatch):
    adam = importlib.import_module("torch.optim.adam")
    real = adam._single_tensor_adam

    def changed(params, *args, **kwargs):
        real(params, *args, **kwargs)
        for param in params:
            param.mul_(1 + 2**-20)

    monkeypatch.setattr(adam, "_single_tensor_adam", changed)


def _new_global_hook_table(monkeypatch):
    from torch.nn.modules import module as module_globals

    monkeypatch.setattr(module_globals, "_global_forward_hooks_on_error", {}, raising=False)


def _global_hooks_elsewhere(monkeypatch):
    from torch.nn.modules import module as module_globals

    monkeypatch.setattr(module_globals, "register_module_forward_hook",  # registering no longer lands in the table
                        lambda hook: SimpleNamespace(remove=lambda: None))


def _log_softmax_backward_changed(monkeypatch):
    monkeypatch.setattr(torch, "_log_softmax_backward_data", lambda grad, out, dim, dtype: grad)


def _mkldnn_op_gone(monkeypatch):
    monkeypatch.setattr(torch_internals, "mkldnn_linear", lambda *a: (_ for _ in ()).throw(RuntimeError("no such op")))


@pytest.mark.parametrize("detail, change, named", [
    ("generator_state", _grow_state, "torch.get_rng_state()'s layout"),
    ("generator_state", _moved_words, "after manual_seed(1234) the words are not at byte"),
    ("adamw_init_group", _init_group_gone, "torch.optim.AdamW has no _init_group"),
    ("adamw_init_group", _init_group_takes_more, "torch.optim.AdamW._init_group(group, params"),
    ("adamw_init_group", _init_group_without_state, "the lists it fills are not"),
    ("adamw_step", _adam_arithmetic_changed, "_single_tensor_adam's arithmetic"),
    ("module_hook_tables", _new_global_hook_table, "_global_forward_hooks_on_error"),
    ("module_hook_tables", _global_hooks_elsewhere, "a registered hook is not in _global_forward_hooks"),
    ("log_softmax_backward_data", _log_softmax_backward_changed, "no longer autograd's gradient of log_softmax"),
    ("mkldnn_linear", _mkldnn_op_gone, "calling them failed (RuntimeError: no such op)"),
], ids=lambda value: getattr(value, "__name__", None))
def test_each_check_names_the_torch_detail_that_changed(monkeypatch, detail, change, named):
    """The checks themselves: each change of a detail torch could make is caught, with a line naming it."""
    change(monkeypatch)
    problem = torch_internals.CHECKS[detail]()
    assert problem is not None and named in problem, problem


def test_checking_leaves_the_global_random_stream_alone():
    """The checks seed, draw and build modules: deciding the fast paths at the start of a run must not move the
    stream the run samples from."""
    torch.manual_seed(7)
    torch.rand(3)
    state = torch.get_rng_state()
    assert paths.in_use() == dict.fromkeys(paths.FAST_PATHS, "fast")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_check_asked_first_inside_a_no_grad_pass_still_passes(context):
    """The fast paths are decided where first used, which may be a log-prob pass under no_grad or inference mode
    (update.add_logprobs): a check that differentiates must not fail there and turn its path off."""
    paths.why_not.cache_clear()
    with context():
        assert paths.in_use() == dict.fromkeys(paths.FAST_PATHS, "fast")
    paths.why_not.cache_clear()


def test_a_check_asked_first_inside_a_checkpointed_forward_leaves_its_recomputation_alone():
    """Asked first inside a checkpointed chunk (the log-prob passes recompute chunks in the backward), a check
    that differentiated saved tensors in the forward that the recomputation (the answer cached) did not: the
    backward failed. The checks run in their own thread, out of reach of the checkpoint's hooks."""
    from torch.utils.checkpoint import checkpoint

    paths.why_not.cache_clear()
    x = torch.ones(3, requires_grad=True)

    def chunk(t):
        assert paths.in_use() == dict.fromkeys(paths.FAST_PATHS, "fast")
        return (t * t).sum()

    checkpoint(chunk, x, use_reentrant=False).backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    paths.why_not.cache_clear()


# ----------------------------------------------------------------------------- the fallbacks


def test_a_failing_check_turns_its_fast_path_off_with_one_warning(monkeypatch, caplog):
    _fail_check(monkeypatch, "generator_state", "the twister moved")
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        assert not paths.usable("draw") and not paths.usable("draw")
        assert paths.usable("adamw")
    lines = [r.getMessage() for r in caplog.records if "CPU fast path off" in r.getMessage()]
    assert len(lines) == 1 and "the twister moved" in lines[0] and "numpy and native" in lines[0], lines
    assert paths.in_use() == {**dict.fromkeys(paths.FAST_PATHS, "fast"), "draw": "plain"}


def test_the_environment_turns_fast_paths_off_by_name(monkeypatch):
    monkeypatch.setenv(paths.PLAIN_ENV, "adamw, onednn_linear")
    assert paths.in_use() == {**dict.fromkeys(paths.FAST_PATHS, "fast"), "adamw": "plain", "onednn_linear": "plain"}
    assert paths.why_not("adamw") == f"{paths.PLAIN_ENV} names it"
    monkeypatch.setenv(paths.PLAIN_ENV, "all")
    paths.why_not.cache_clear()
    assert set(paths.in_use().values()) == {"plain"}
    monkeypatch.setenv(paths.PLAIN_ENV, "adamw,fast_everything")
    paths.why_not.cache_clear()
    with pytest.raises(ConfigError, match="GRPO_TRAINER_CPU_PLAIN: fast_everything is not a CPU fast path; choose from draw, adamw"):
        paths.usable("adamw")


def test_without_its_generator_details_every_draw_is_torchs(monkeypatch):
    """The emulations read torch's generator state: where it is not as they expect, only torch's own draw is
    offered to the plan, and an emulation called anyway draws as torch does."""
    _fail_check(monkeypatch, "generator_state")
    assert draw.available_draws() == ["torch"]
    probs = torch.softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3, -1)
    for name in ("numpy", "native"):
        torch.manual_seed(3)
        expected, state = torch.multinomial(probs, 1)[:, 0], None
        state = torch.get_rng_state()
        torch.manual_seed(3)
        assert torch.equal(draw.DRAWS[name](probs), expected) and torch.equal(torch.get_rng_state(), state), name


def test_a_run_planned_with_an_emulated_draw_keeps_its_other_choices_where_the_draw_cannot_run(tiny_model_path,
                                                                                                 monkeypatch, caplog):
    """The draw's fallback goes through the decode kernel plan: a resumed plan that recorded an emulated draw gets
    torch's (the same tokens) with one line per shape, and keeps every other recorded choice."""
    from test_kernel_plan import FAST_OTHERS, _every_decision_measured, _tiny

    from grpo_trainer.rollout import kernels
    from grpo_trainer.rollout.decode import plan_decode_kernels

    _every_decision_measured(monkeypatch, FAST_OTHERS)
    lm = _tiny(tiny_model_path)
    recorded = plan_decode_kernels(lm, 4, 40, kernels.KernelTable(None))
    draws = {key for key, name in recorded.items() if key.startswith("draw/")}
    assert draws and all(recorded[key] == "numpy" for key in draws)
    _fail_check(monkeypatch, "generator_state")
    with caplog.at_level(logging.WARNING):
        resumed = plan_decode_kernels(lm, 4, 40, kernels.KernelTable(None), recorded=recorded)
    assert resumed == {key: "torch" if key in draws else name for key, name in recorded.items()}
    cannot = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(cannot) == len(draws) and "samples differ" not in " ".join(cannot), cannot


def test_without_its_torch_details_the_optimizer_is_torchs(monkeypatch):
    cpu = SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=None))
    assert adamw_for(cpu) is BlockwiseAdamW
    _fail_check(monkeypatch, "adamw_init_group")
    assert adamw_for(cpu) is torch.optim.AdamW


def test_without_its_torch_details_the_onednn_linear_is_not_offered(monkeypatch):
    if "onednn_packed" not in available_linears(torch.float32):
        pytest.skip("this torch has no oneDNN")
    _fail_check(monkeypatch, "mkldnn_linear")
    assert available_linears(torch.float32) == ["weight_stationary", "linear"]


@pytest.mark.parametrize("layout", ["shared_prompt", "packed"])
def test_the_plain_log_prob_path_gives_the_fast_paths_numbers(tiny_model_path, monkeypatch, layout):
    """With the tied head's and the log-prob function's fast paths off (autograd's paths), the log-probs, the
    entropies and every gradient are bit for bit the fast paths'."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import (TokenLogprobs, load_causal_lm, load_tokenizer, make_packed_batch,
                                     make_sequence_batch)

    tokenizer = load_tokenizer(ModelConfig())
    batch = (make_packed_batch if layout == "packed" else make_sequence_batch)(
        [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]], [[5, 7, 9], [4], [12, 3]], tokenizer.pad_token_id)
    lm = load_causal_lm(ModelConfig()).train()
    used = []
    for function in (lm_head.TiedHead, lm_head.TargetLogprobs):
        monkeypatch.setattr(function, "apply", lambda *a, real=function.apply, name=function.__name__: used.append(name)
                            or real(*a))

    def scored():
        lm.zero_grad(set_to_none=True)
        logp, entropy = TokenLogprobs(lm, temperature=0.7, share_prompt=layout != "packed")(
            **batch.tensors(), with_entropy=True)
        (logp * batch.completion_mask).sum().backward()
        return [logp.detach(), entropy] + [p.grad for p in lm.parameters()]

    fast = scored()
    assert sorted(set(used)) == ["TargetLogprobs", "TiedHead"]
    used.clear()
    monkeypatch.setenv(paths.PLAIN_ENV, "tied_head,target_logprobs")
    paths.why_not.cache_clear()
    plain = scored()
    assert used == []
    assert all(torch.equal(a, b) for a, b in zip(fast, plain) if a is not None)


# ----------------------------------------------------------------------------- in a run


@pytest.mark.slow
def test_a_run_on_the_plain_paths_is_the_same_run_and_records_it(tmp_path, tiny_model_path):
    """Every fast path off: the same weights and metrics as the default run for the same seed, one warning per
    path, "plain" recorded beside the config and in the checkpoint; resumed with the fast paths on, a line says
    for each that it now runs differently."""
    fast, plain = tmp_path / "fast", tmp_path / "plain"
    for out, env in ((fast, {}), (plain, {paths.PLAIN_ENV: "all"})):
        result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 2), "checkpoint.save_every=2"], env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        if env:
            warned = [line for line in result.stderr.splitlines() if "CPU fast path off" in line]
            assert len(warned) == len(paths.FAST_PATHS) and all("GRPO_TRAINER_CPU_PLAIN names it" in w for w in warned)
    assert_same_run(fast, plain)
    expected = {out: dict.fromkeys(paths.FAST_PATHS, "fast" if out == fast else "plain") for out in (fast, plain)}
    for out in (fast, plain):
        assert json.loads((out / "decode_kernels.json").read_text())["cpu_paths"] == expected[out]
        assert json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())["cpu_paths"] == expected[out]
    overrides = [o for o in small_run_overrides(plain, 3) if "resume" not in o] + ["checkpoint.resume=auto"]
    resumed = run_cli(["train", "configs/demo_cpu.yaml", *overrides])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in paths.FAST_PATHS:
        assert f"CPU fast path {name}: the run ran it plain, this process runs it fast" in resumed.stderr, name
