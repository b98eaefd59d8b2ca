"""`grpo_trainer.plot`: PNGs from metrics.jsonl, readable images, skipped panels, clear errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402
import numpy as np  # noqa: E402

from grpo_trainer.errors import DataError  # noqa: E402
from grpo_trainer.plot import plot_run, read_run  # noqa: E402
from helpers import run_cli, small_run_overrides  # noqa: E402

ALL_PANELS = {"reward", "zero_std", "completion_length", "kl", "entropy", "clip_ratio", "step_time", "eval", "overview"}


def synthetic_rows(steps: int = 60, seed: int = 0) -> list[dict]:
    """Lines shaped like the trainer's: nulls where unmeasured, checkpoint and eval only on some steps."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        reward = min(1.0, 0.3 + 0.6 * step / steps + rng.uniform(-0.1, 0.1))
        row = {
            "step": step,
            "reward": reward,
            "reward_std": 0.3 * (1 - step / steps) + 0.02,
            "frac_reward_zero_std": min(1.0, 0.2 + 0.7 * step / steps),
            "loss": rng.uniform(-0.01, 0.01),
            "completions/mean_length": 10 + rng.uniform(-1, 1),
            "completions/max_length": 16.0,
            "completions/mean_length_correct": 12 + rng.uniform(-1, 1),
            # All answers right at the end: no incorrect completions, logged as null (NaN in the trainer).
            "completions/mean_length_incorrect": None if step > steps - 5 else 9 + rng.uniform(-1, 1),
            "kl": 0.001 * step,
            "entropy": 0.4 - 0.003 * step,
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.01 * rng.random(),
            "clip_ratio/region_mean": 0.02 * rng.random(),
            "rewards/math_accuracy/mean": reward,
            "rewards/think_format/mean": 0.5,
            "timing/rollout": 0.8 + rng.uniform(0, 0.1),
            "timing/reward": 0.3,
            "timing/logprobs": 0.01,
            "timing/update": 0.5,
            "step_time": 1.9,
        }
        if step % 20 == 0:
            row["timing/checkpoint"] = 0.4
            row["step_time"] += 0.4
        if step % 15 == 0:
            row["eval/math_accuracy/mean@4"] = reward - 0.05
            row["eval/math_accuracy/pass@4"] = min(1.0, reward + 0.2)
            row["eval/reward/mean@4"] = reward - 0.05
            row["eval/reward/pass@4"] = min(1.0, reward + 0.2)
            row["eval/num_prompts"] = 20
        rows.append(row)
    return rows


def write_metrics(folder: Path, rows: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return folder


def assert_readable_png(path: Path, min_width: int = 400) -> None:
    image = mpimg.imread(path)  # [H, W, channels], floats in [0, 1]
    height, width = image.shape[:2]
    assert width >= min_width and height >= 250, f"{path.name} is only {width}x{height}"
    rgb = image[..., :3]
    assert rgb.std() > 0.02, f"{path.name} is (nearly) one colour"
    # More than a frame and a title: a good share of pixels are neither white nor the dominant colour.
    not_white = (rgb < 0.95).any(-1).mean()
    assert not_white > 0.02, f"{path.name} has almost nothing drawn ({not_white:.3f} of pixels)"


def test_every_panel_is_written_and_readable(tmp_path):
    run_dir = write_metrics(tmp_path / "run", synthetic_rows())
    written = plot_run(run_dir)
    assert {p.stem for p in written} == ALL_PANELS
    assert all(p.parent == run_dir / "plots" for p in written)
    for path in written:
        assert_readable_png(path)


def test_missing_metrics_are_skipped_and_reported(tmp_path):
    rows = [
        {k: v for k, v in r.items() if k != "kl" and not k.startswith(("eval/", "timing/"))} | {"entropy": None}
        for r in synthetic_rows(steps=5)
    ]
    run_dir = write_metrics(tmp_path / "run", rows)
    notes: list[str] = []
    written = plot_run(run_dir, tmp_path / "elsewhere", on_skip=notes.append)
    assert {p.stem for p in written} == ALL_PANELS - {"kl", "eval", "step_time", "entropy"}
    assert all(p.parent == tmp_path / "elsewhere" for p in written)
    skipped = " ".join(notes)
    for panel in ("kl", "eval", "step_time", "entropy"):
        assert f"skipped {panel}:" in skipped
    assert "loss.beta > 0" in skipped  # says why KL is absent


def test_a_half_written_last_line_and_a_relogged_step_are_tolerated(tmp_path):
    rows = synthetic_rows(steps=4)
    rows.append(dict(rows[1], reward=0.123))  # step 2 logged again (e.g. after a resume)
    run_dir = write_metrics(tmp_path / "run", rows, tail='{"step": 5, "rew')
    run = read_run(run_dir)
    assert run.steps == [1.0, 2.0, 3.0, 4.0]
    assert run.get("reward")[1] == 0.123
    assert run.skipped_lines == 1
    assert math.isnan(run.get("eval/reward/pass@4")[0])
    assert {p.stem for p in plot_run(run_dir)} >= {"reward", "overview"}


def test_no_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"no metrics file at .*metrics\.jsonl"):
        plot_run(tmp_path / "nothing-here")
    write_metrics(tmp_path / "empty", [])
    with pytest.raises(DataError, match="no metric lines"):
        plot_run(tmp_path / "empty")


def test_reward_band_is_drawn_around_the_reward(tmp_path):
    """The ±std band must widen the filled area: a run with a wide std has more coloured pixels."""
    from grpo_trainer.plot import RunMetrics, _figure_class, panel_reward

    steps = [float(s) for s in range(1, 31)]
    areas = []
    for std in (0.0, 0.3):
        run = RunMetrics(steps=steps, columns={"reward": [0.5] * 30, "reward_std": [std] * 30})
        fig = _figure_class()(figsize=(8, 4.5))
        assert panel_reward(fig.subplots(), run) is None
        fig.savefig(tmp_path / f"{std}.png", dpi=60)
        areas.append((mpimg.imread(tmp_path / f"{std}.png")[..., :3] < 0.95).any(-1).mean())
    assert areas[1] > areas[0] + 0.05, areas


@pytest.mark.slow
def test_plots_of_a_real_training_run(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    written = {p.stem: p for p in plot_run(out)}
    # A real 2-step run with beta = 0 and no evaluation: everything but KL and eval.
    assert set(written) == ALL_PANELS - {"kl", "eval"}
    for path in written.values():
        assert_readable_png(path)
    assert np.asarray(mpimg.imread(written["overview"])).shape[1] > np.asarray(mpimg.imread(written["reward"])).shape[1]
