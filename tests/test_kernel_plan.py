"""The decode loop's kernel plan (rollout/kernels.py, decode.plan_decode_kernels): made before a run samples
anything, covering every shape the loop reaches, recorded in the run and its checkpoints, kept on resume; the
decisions that change numerics made by rule, only the exact ones (the draws) by timing.

The end-to-end tests make every decision worth deciding on the tiny model and inject timings under which
non-incumbent alternatives win (helpers.cli_with_kernel_timings), so the timed path and the rule's
non-incumbent choice really run: the same config and seed must then give the same run on two fresh kernel
caches timed differently, and across a kill -9 and a resume on a machine whose (empty) cache would time
otherwise.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from grpo_trainer.cpu.attention import attention_library
from grpo_trainer.cpu.layer_ops import layer_library
from grpo_trainer.cpu.draw import available_draws
from grpo_trainer.cpu.linear import available_linears
from grpo_trainer.rollout import kernels
from grpo_trainer.rollout.decode import INCUMBENT, ROUNDS_DIFFERENTLY, DecodeKernels, plan_decode_kernels
from helpers import assert_same_run, cli_with_kernel_timings, run_in_fork, small_run_overrides

# Under these timings every decision's winner is not today's incumbent; under OTHER_MACHINE, another one wins.
FAST_OTHERS = {"linear": 0.1, "onednn_packed": 0.5, "weight_stationary": 1.0,
               "grouped_matmul": 0.1, "repeated": 0.5, "grouped": 1.0, "numpy": 0.1, "native": 0.5, "torch": 1.0}
OTHER_MACHINE = {"onednn_packed": 0.1, "linear": 0.5, "weight_stationary": 1.0,
                 "repeated": 0.1, "grouped_matmul": 0.5, "grouped": 1.0, "native": 0.1, "numpy": 0.5, "torch": 1.0}
# What the rule picks for the tiny model's float32 linears once they count as worth it, whatever the timings.
RULE_LINEAR = "onednn_packed" if "onednn_packed" in available_linears(torch.float32) else INCUMBENT["linear"]
OTHER_MACHINE_DRAW = "native" if "native" in available_draws() else "numpy"
# ... and for its one-token attention (the C kernel, where it builds here).
RULE_ATTENTION = "native" if attention_library() is not None else INCUMBENT["attention"]
# ... and for its decode step as a whole (the small operators in C, where they build here).
RULE_STEP = "fused" if layer_library() is not None else INCUMBENT["step"]


def numerics(plan: dict[str, str]) -> dict[str, str]:
    """The plan's decisions that change what a run samples (the rest, the draws, are exact)."""
    return {key: name for key, name in plan.items() if key.split("/")[0] in ROUNDS_DIFFERENTLY}


def _tiny(tiny_model_path):
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_causal_lm

    return load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))).eval()


def _every_decision_measured(monkeypatch, timings):
    monkeypatch.setattr(kernels, "MIN_WORK_BYTES", 0)
    monkeypatch.setattr(kernels, "MIN_DRAW_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "time_alternatives", lambda candidates, **_: {k: timings.get(k, 1.0) for k in candidates})


def test_the_plan_covers_every_shape_the_decode_loop_reaches(tiny_model_path, monkeypatch):
    """A generate of 3 prompts x 5 completions (rows leaving as they finish) looks up only planned shapes, and
    samples with the plan's (non-incumbent) choices; the loop itself never times anything."""
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout import hf

    _every_decision_measured(monkeypatch, FAST_OTHERS)
    lm = _tiny(tiny_model_path)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    settings = SamplingSettings(eos_token_ids=[2], max_completion_length=20)
    plan = plan_decode_kernels(lm, 3 * 5, 7 + 20, kernels.KernelTable(None))
    assert set(plan.values()) == {RULE_LINEAR, RULE_ATTENTION, RULE_STEP, "numpy"}, plan
    loops = []
    monkeypatch.setattr(hf, "decode_kernels", lambda model, p: loops.append(DecodeKernels(model, p)) or loops[-1])
    monkeypatch.setattr(kernels, "time_alternatives", lambda *a, **k: pytest.fail("timed while sampling"))
    engine = hf.HFEngine(settings, get_model=lambda: lm, pad_token_id=0, kernel_plan=plan)
    engine.generate(prompts, 5)
    used = {key for loop in loops for key in loop.chosen}
    assert used and used <= set(plan), sorted(used - set(plan))
    assert all(loop.chosen[key] == plan[key] for loop in loops for key in loop.chosen)


def test_an_engine_without_a_plan_makes_one_before_it_samples(tiny_model_path, monkeypatch):
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.hf import HFEngine

    _every_decision_measured(monkeypatch, FAST_OTHERS)
    table = kernels.KernelTable(None)
    monkeypatch.setattr(kernels, "default_table", lambda: table)
    engine = HFEngine(SamplingSettings(eos_token_ids=[2], max_completion_length=8), get_model=lambda: _tiny(tiny_model_path),
                      pad_token_id=0)
    engine.generate([[5, 6, 7]], 4)
    assert engine.kernel_plan and engine.kernel_plan["linear/" + "x".join(map(str, (96, 96, 4)))] == RULE_LINEAR


def test_decisions_that_change_numerics_follow_the_rule_whatever_the_timings(tiny_model_path, monkeypatch):
    """Two fresh caches on machines that time every alternative differently plan the same linear forms and
    attention paths (the rule's); only the exact draws follow the timings. Nothing that rounds is timed."""
    lm = _tiny(tiny_model_path)
    plans = []
    for timings in (FAST_OTHERS, OTHER_MACHINE):
        timed = []

        def timing(candidates, timings=timings, timed=timed, **_):
            timed.append(set(candidates))
            return {k: timings.get(k, 1.0) for k in candidates}

        monkeypatch.setattr(kernels, "MIN_WORK_BYTES", 0)
        monkeypatch.setattr(kernels, "MIN_DRAW_ELEMENTS", 0)
        monkeypatch.setattr(kernels, "time_alternatives", timing)
        plans.append(plan_decode_kernels(lm, 16, 100, kernels.KernelTable(None)))
        assert timed and all(names == set(available_draws()) for names in timed), timed
    assert numerics(plans[0]) == numerics(plans[1]) and numerics(plans[0])
    assert set(numerics(plans[0]).values()) == {RULE_LINEAR, RULE_ATTENTION, RULE_STEP}
    assert {plans[0][k] for k in plans[0] if k.startswith("draw/")} == {"numpy"}
    assert {plans[1][k] for k in plans[1] if k.startswith("draw/")} == {OTHER_MACHINE_DRAW}


def test_a_recorded_plan_is_kept_whatever_this_machine_would_choose(tiny_model_path, monkeypatch, caplog):
    """A resumed run keeps its recorded choices where they can run here; one that cannot (an alternative this
    machine lacks) is replaced with one warning line naming it; other shapes of its decisions are planned here, and a
    decision it has no entry of at all (it predates it) keeps the incumbent, as that run sampled."""
    _every_decision_measured(monkeypatch, FAST_OTHERS)
    lm = _tiny(tiny_model_path)
    here = plan_decode_kernels(lm, 8, 40, kernels.KernelTable(None))
    linear_key, draw_key = "linear/96x96x8", "draw/8x128"
    recorded = {linear_key: "linear", draw_key: "a_draw_that_is_gone"}
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.rollout.decode"):
        plan = plan_decode_kernels(lm, 8, 40, kernels.KernelTable(None), recorded=recorded)
    assert here[linear_key] == RULE_LINEAR and plan[linear_key] == "linear"
    assert plan[draw_key] == here[draw_key] == "numpy"
    # Decisions the record has no entry of (it predates them: attention, step) keep the incumbent its run used;
    # the other shapes of its decisions are planned here
    predated = {key for key in here if key.split("/")[0] in ("attention", "step")}
    assert {here[key] for key in predated} == {RULE_ATTENTION, RULE_STEP}
    assert all(plan[key] == INCUMBENT[key.split("/")[0]] for key in predated)
    step_key = next(key for key in here if key.startswith("step/"))
    newer = plan_decode_kernels(lm, 8, 40, kernels.KernelTable(None), recorded={linear_key: "linear", step_key: RULE_STEP})
    assert newer[step_key] == RULE_STEP
    rest = set(plan) - set(recorded) - predated
    assert {k: plan[k] for k in rest} == {k: here[k] for k in rest} and rest
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # not other tests' INFO
    assert len(lines) == 1 and "a_draw_that_is_gone" in lines[0] and draw_key in lines[0], lines


def test_a_forced_choice_wins_over_the_recorded_one_and_says_so(tiny_model_path, monkeypatch, caplog):
    monkeypatch.setenv(kernels.FORCE_ENV, "linear=linear")
    lm = _tiny(tiny_model_path)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.rollout.decode"):
        plan = plan_decode_kernels(lm, 1, 10, kernels.KernelTable(None), recorded={"linear/96x96x1": "weight_stationary"})
    assert plan["linear/96x96x1"] == "linear"
    assert any(kernels.FORCE_ENV in r.getMessage() for r in caplog.records)


def test_a_plan_without_an_entry_runs_the_incumbent():
    layer = torch.nn.Linear(4, 3)
    loop = DecodeKernels(torch.nn.Sequential(layer), {"linear/3x4x2": "linear"})
    loop.linear_form(layer, 2), loop.linear_form(layer, 8)
    assert loop.chosen == {"linear/3x4x2": "linear", "linear/3x4x8": INCUMBENT["linear"]}


def _train(out, steps, timings, cache, *extra, resume="never", kill_after_save=0):
    overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
    args = ["train", "configs/demo_cpu.yaml", *overrides, f"checkpoint.resume={resume}", *extra]
    return run_in_fork(cli_with_kernel_timings, (args, timings, str(cache), kill_after_save), timeout=600)


@pytest.mark.slow
def test_same_seed_same_run_on_two_fresh_caches_and_across_a_kill_and_resume(tmp_path, tiny_model_path):
    """Runs A and B start on fresh kernel caches of machines that time every alternative differently: the same
    plan for every decision that changes numerics (only the exact draws differ), identical metrics,
    bit-identical weights. Run C is killed -9 right after its step-2 checkpoint and resumed in a process whose
    kernel cache is empty and whose timings differ: it keeps the recorded plan and ends bit-identical to A."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, timings in ((a, FAST_OTHERS), (b, OTHER_MACHINE)):
        result = _train(out, 3, timings, tmp_path / f"{out.name}-kernels.json")
        assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((a / "decode_kernels.json").read_text())["choices"]
    other = json.loads((b / "decode_kernels.json").read_text())["choices"]
    assert set(numerics(plan).values()) == {RULE_LINEAR, RULE_ATTENTION, RULE_STEP}  # the rule's non-incumbent forms ran
    assert numerics(other) == numerics(plan)
    assert {other[k] for k in other if k.startswith("draw/")} == {OTHER_MACHINE_DRAW}  # the timed path ran
    assert_same_run(a, b)

    killed = _train(c, 3, FAST_OTHERS, tmp_path / "c-kernels.json", "checkpoint.save_every=2", kill_after_save=2)
    assert killed.returncode == -9 and (c / "checkpoints" / "step-000002").is_dir(), killed.stderr[-3000:]
    resumed = _train(c, 3, OTHER_MACHINE, tmp_path / "empty" / "kernels.json", "checkpoint.save_every=2", resume="auto")
    assert resumed.returncode == 0 and "at step 2" in resumed.stderr, resumed.stderr[-3000:]
    assert "cannot run here" not in resumed.stderr
    assert json.loads((c / "decode_kernels.json").read_text())["choices"] == plan
    assert not (tmp_path / "empty" / "kernels.json").exists()  # nothing was measured: the record was complete
    assert_same_run(a, c)


def test_the_kernels_command_remeasures_only_when_asked_and_says_what_changed(tmp_path, monkeypatch, capsys):
    from grpo_trainer.cli import main

    timings = dict(FAST_OTHERS)
    _every_decision_measured(monkeypatch, timings)
    table = kernels.KernelTable(tmp_path / "kernels.json")
    monkeypatch.setattr(kernels, "default_table", lambda: table)
    args = ["kernels", "configs/demo_cpu.yaml", "train.prompts_per_step=2", "rollout.num_generations=2", "train.micro_batch_size=4"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "linear/96x96x4" in first and "changed" not in first and "(was" not in first
    timings.update(OTHER_MACHINE)
    assert main(args) == 0  # cached: the new timings are not consulted
    assert capsys.readouterr().out == first
    assert main([*args, "--remeasure"]) == 0
    out = capsys.readouterr().out
    assert f"{OTHER_MACHINE_DRAW}   (was numpy)" in out and "(was " + RULE_LINEAR not in out, out
    assert "choices changed: only exact alternatives are timed" in out


def test_the_engine_settles_its_plan_for_the_reach_it_was_built_with(tiny_model_path, monkeypatch):
    """The run builds the hf engine with its reach and hands it the recorded plan: the plan covers that reach, keeps
    the recorded choices, and is what the engine then samples with (no planning at its first generate)."""
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout import hf
    from grpo_trainer.rollout.kernel_plan import DecodeReach, KernelPlanning

    _every_decision_measured(monkeypatch, FAST_OTHERS)
    table = kernels.KernelTable(None)
    monkeypatch.setattr(kernels, "default_table", lambda: table)
    lm = _tiny(tiny_model_path)
    recorded = {"linear/96x96x8": "linear"}
    engine = hf.HFEngine(SamplingSettings(eos_token_ids=[2], max_completion_length=8), get_model=lambda: lm,
                         pad_token_id=0, planning=KernelPlanning(DecodeReach(8, 40)))
    plan = engine.settle_kernels(recorded)
    assert plan == plan_decode_kernels(lm, 8, 40, table, recorded=recorded) and plan["linear/96x96x8"] == "linear"
    assert engine.kernel_plan == plan
    monkeypatch.setattr(hf, "plan_decode_kernels", lambda *a, **k: pytest.fail("planned again at generate"))
    engine.generate([[5, 6, 7]], 2)


def test_the_token_endpoint_widens_the_plan_keeping_every_choice(tiny_model_path, monkeypatch):
    """`widen_kernels` (agents/sampler.py, before the endpoint's first batch) covers more rows and a longer
    context, and keeps every choice the engine's plan already held, whatever this machine would choose."""
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.hf import HFEngine

    _every_decision_measured(monkeypatch, FAST_OTHERS)
    monkeypatch.setattr(kernels, "default_table", lambda: kernels.KernelTable(None))
    lm = _tiny(tiny_model_path)
    held = {"linear/96x96x1": "linear", "draw/1x128": "torch"}
    engine = HFEngine(SamplingSettings(eos_token_ids=[2], max_completion_length=8), get_model=lambda: lm,
                      pad_token_id=0, kernel_plan=held)
    engine.widen_kernels(8, 100)
    assert engine.kernel_plan is not None and held.items() <= engine.kernel_plan.items()
    assert set(engine.kernel_plan) == set(plan_decode_kernels(lm, 8, 100, kernels.KernelTable(None)))


def test_a_planning_error_on_the_main_process_stops_every_rank_with_its_line():
    """Only the main process plans; the others wait for its plan in a gather. Whatever planning raises there is
    carried through that gather, so every rank stops with the same line instead of waiting forever; with one
    process, the error itself."""
    from grpo_trainer.errors import ConfigError, TrainingError
    from grpo_trainer.rollout.kernel_plan import DecodeReach, KernelPlanning, settle

    carried = []

    def plan_here(decides):
        if decides:
            raise ConfigError("GRPO_TRAINER_DECODE_KERNELS: linear='x' is not available here")
        return {}

    def gather(item):
        carried.append(item) if not carried else None
        return carried[0]

    for decides in (True, False):  # the main process first: its item is what the gather hands everyone
        with pytest.raises(TrainingError, match="decode kernels: GRPO_TRAINER_DECODE_KERNELS: linear='x'"):
            settle(KernelPlanning(DecodeReach(4, 64), decides=decides, share=gather), plan_here)
    with pytest.raises(ConfigError, match="linear='x'"):
        settle(KernelPlanning(DecodeReach(4, 64)), plan_here)
    assert settle(KernelPlanning(DecodeReach(4, 64), decides=False, share=lambda item: ({"a": "b"}, None)),
                  plan_here) == {"a": "b"}  # the main process's plan, on a rank that planned nothing
