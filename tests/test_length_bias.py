"""scripts/length_bias.py, shortened: GRPO's per-sequence mean drifts lengths, Dr. GRPO's constant does not.

Liu et al. 2025 (Dr. GRPO), sec. 3.1. 100 steps x 2 seeds take a few seconds; by
step 100 the full run's gap is ~8 tokens under grpo and ~0 under dr_grpo.
"""

from __future__ import annotations

import json

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("length_bias") / "length_bias.json"
    results = load_script("length_bias").main(["--steps", "100", "--seeds", "2", "--plot", "", "--json", str(json_path)])
    return results, json.loads(json_path.read_text())


def test_json_has_the_documented_structure(short_run):
    results, written = short_run
    assert written == results
    assert list(written) == ["grpo", "dr_grpo"]
    for loss_type, table in written.items():
        assert list(table) == ["1", "50", "100"], loss_type  # checkpoints <= --steps; the final step is 100
        for step, stats in table.items():
            assert set(stats) == {"accuracy", "right_length", "wrong_length"}, (loss_type, step)
            assert 0.0 <= stats["accuracy"] <= 1.0
            assert 2.0 <= stats["right_length"] <= 40.0 and 2.0 <= stats["wrong_length"] <= 40.0


def test_both_start_near_nine_tokens_and_learn(short_run):
    results, _ = short_run
    for loss_type, table in results.items():
        first, last = table["1"], table["100"]
        assert abs(first["right_length"] - 9) < 0.5 and abs(first["wrong_length"] - 9) < 0.5, loss_type
        assert first["accuracy"] < 0.35 and last["accuracy"] > 0.75, loss_type
    # The step sizes are tuned so that both learn at a similar pace.
    assert abs(results["grpo"]["100"]["accuracy"] - results["dr_grpo"]["100"]["accuracy"]) < 0.1


def test_grpo_makes_right_answers_short_and_wrong_answers_long(short_run):
    results, _ = short_run
    final = results["grpo"]["100"]
    assert final["right_length"] < 6.0  # from ~9
    assert final["wrong_length"] > 10.5  # from ~9
    assert final["wrong_length"] - final["right_length"] > 5.0


def test_dr_grpo_keeps_both_lengths_near_where_they_started(short_run):
    results, _ = short_run
    final = results["dr_grpo"]["100"]
    assert abs(final["wrong_length"] - final["right_length"]) < 1.0
    assert abs(final["right_length"] - 9) < 1.0 and abs(final["wrong_length"] - 9) < 1.0


def test_first_checkpoints_and_final_step_when_steps_is_not_a_checkpoint():
    module = load_script("length_bias")
    curves = {"grpo": {s: {"accuracy": s / 70} for s in range(1, 71)}}
    assert list(module.checkpoint_table(curves, 70)["grpo"]) == ["1", "50", "70"]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")  # optional extra `plot`
    module = load_script("length_bias")
    curves = module.run(steps=3, seeds=1)
    module.plot(curves, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
