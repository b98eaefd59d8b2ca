"""Plots of a run: OUTPUT_DIR/metrics.jsonl -> PNGs in OUTPUT_DIR/plots/.

One PNG per panel, plus `overview.png` with every panel on one page:

    reward.png               reward with a +-reward_std band (the mean within-group std), each reward's mean
    zero_std.png             frac_reward_zero_std: share of groups whose rewards are all equal (no signal)
    completion_length.png    mean completion length, of correct (reward > 0) and incorrect completions
    kl.png                   KL to the reference (only logged when loss.beta > 0)
    entropy.png              mean token entropy of the policy
    clip_ratio.png           share of tokens clipped below / above / in the clip region
    step_time.png            seconds per step, stacked by phase (timing/*)
    eval.png                 eval/* metrics, one subplot per reward

A panel whose metrics are absent from every line is skipped and reported, not
drawn empty. `null` values (not measured on that step) leave gaps.

matplotlib is an optional dependency (`pip install 'grpo-trainer[plot]'`); it
is imported only when plotting, and figures are rendered by the Agg canvas
without pyplot: no window, works headless, and the caller's backend is untouched.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import DataError, UserError

logger = logging.getLogger("grpo_trainer")

TIMING_ORDER = [
    "timing/rollout",
    "timing/reward",
    "timing/logprobs",
    "timing/update",
    "timing/weight_sync",
    "timing/checkpoint",
]
SMOOTH_MIN_POINTS = 20  # add a rolling mean to noisy curves with at least this many points
MARKERS_MAX_POINTS = 40  # draw point markers on short runs, so 1-2 steps are visible


class PlotDependencyError(UserError):
    """matplotlib is not installed."""


@dataclass
class RunMetrics:
    """The metrics of one run as columns: step -> value lists aligned with `steps` (NaN = not logged)."""

    steps: list[float]
    columns: dict[str, list[float]]
    skipped_lines: int = 0

    def has(self, key: str) -> bool:
        return any(not math.isnan(v) for v in self.columns.get(key, ()))

    def get(self, key: str) -> list[float]:
        return self.columns.get(key, [math.nan] * len(self.steps))

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.columns if k.startswith(prefix) and self.has(k)]


@dataclass
class PlotReport:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # panel -> why


def read_run(output_dir: str | Path) -> RunMetrics:
    """Parse OUTPUT_DIR/metrics.jsonl (a trailing half-written line, e.g. from a crash, is skipped)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"no metrics file at {path}: is {output_dir} the output_dir of a training run?")
    rows: dict[float, dict[str, Any]] = {}
    skipped = 0
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(row, dict):
            skipped += 1
            continue
        step = row.get("step", i + 1)
        rows[float(step) if isinstance(step, (int, float)) else float(i + 1)] = row  # a re-logged step wins
    if not rows:
        raise DataError(f"{path} has no metric lines yet")
    steps = sorted(rows)
    keys = list(dict.fromkeys(k for s in steps for k in rows[s] if k != "step"))
    columns = {k: [_number(rows[s].get(k)) for s in steps] for k in keys}
    columns = {k: v for k, v in columns.items() if any(not math.isnan(x) for x in v)}
    return RunMetrics(steps=steps, columns=columns, skipped_lines=skipped)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


# ----------------------------------------------------------------------------- panels
# Each panel draws on the axes it is given and returns None, or returns the reason it has nothing to draw.


def _line(ax, run: RunMetrics, key: str, label: str | None = None, smooth: bool = False, **kw):
    xs, ys = _present(run.steps, run.get(key))
    few = len(xs) <= MARKERS_MAX_POINTS
    (handle,) = ax.plot(run.steps, run.get(key), label=label or key, marker="o" if few else None, markersize=3, **kw)
    if smooth and len(xs) >= SMOOTH_MIN_POINTS:
        ax.plot(
            xs,
            _rolling_mean(ys, max(3, len(xs) // 10)),
            color=handle.get_color(),
            linewidth=2.2,
            alpha=0.9,
            label=f"{label or key} (rolling mean)",
        )
        handle.set_alpha(0.35)
    return handle


def panel_reward(ax, run: RunMetrics) -> str | None:
    if not run.has("reward"):
        return "no `reward` metric"
    handle = _line(ax, run, "reward", "reward (weighted total)", smooth=True)
    if run.has("reward_std"):
        lo = [r - s for r, s in zip(run.get("reward"), run.get("reward_std"))]
        hi = [r + s for r, s in zip(run.get("reward"), run.get("reward_std"))]
        ax.fill_between(
            run.steps,
            lo,
            hi,
            color=handle.get_color(),
            alpha=0.15,
            linewidth=0,
            label="± reward_std (mean std within a group)",
        )
    per_reward = [k for k in run.keys("rewards/") if k.endswith("/mean")]
    if len(per_reward) > 1:  # with one reward its mean is the total (up to its weight): no second line
        for key in per_reward:
            _line(ax, run, key, key.removeprefix("rewards/").removesuffix("/mean"), linestyle="--", linewidth=1)
    ax.set_title("Reward")
    ax.set_ylabel("reward")
    return None


def panel_zero_std(ax, run: RunMetrics) -> str | None:
    if not run.has("frac_reward_zero_std"):
        return "no `frac_reward_zero_std` metric"
    _line(ax, run, "frac_reward_zero_std", "groups with zero reward variance", smooth=True)
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("Groups that teach nothing (frac_reward_zero_std)")
    ax.set_ylabel("fraction of groups")
    return None


def panel_length(ax, run: RunMetrics) -> str | None:
    keys = [
        ("completions/mean_length", "all"),
        ("completions/mean_length_correct", "correct (reward > 0)"),
        ("completions/mean_length_incorrect", "incorrect"),
        ("completions/max_length", "max"),
    ]
    present = [(k, label) for k, label in keys if run.has(k)]
    if not present:
        return "no `completions/*length*` metrics"
    for key, label in present:
        style: dict[str, Any] = {"linestyle": ":", "linewidth": 1} if key.endswith("max_length") else {}
        _line(ax, run, key, label, **style)
    ax.set_title("Completion length")
    ax.set_ylabel("tokens")
    return None


def panel_kl(ax, run: RunMetrics) -> str | None:
    if not run.has("kl"):
        return "no `kl` metric (it is logged only when loss.beta > 0)"
    _line(ax, run, "kl", "KL(policy || reference)", smooth=True)
    ax.set_title("KL to the reference")
    ax.set_ylabel("nats / token")
    return None


def panel_entropy(ax, run: RunMetrics) -> str | None:
    if not run.has("entropy"):
        return "no `entropy` metric"
    _line(ax, run, "entropy", "entropy", smooth=True)
    ax.set_title("Policy entropy")
    ax.set_ylabel("nats / token")
    return None


def panel_clip(ax, run: RunMetrics) -> str | None:
    keys = [
        ("clip_ratio/low_mean", "low (ratio < 1 - eps_low, A < 0)"),
        ("clip_ratio/high_mean", "high (ratio > 1 + eps_high, A > 0)"),
        ("clip_ratio/region_mean", "clipped, either side"),
    ]
    present = [(k, label) for k, label in keys if run.has(k)]
    if not present:
        return "no `clip_ratio/*` metrics"
    for key, label in present:
        _line(ax, run, key, label)
    ax.set_title("Clipped tokens")
    ax.set_ylabel("fraction of tokens")
    return None


def panel_step_time(ax, run: RunMetrics) -> str | None:
    keys = [k for k in TIMING_ORDER if run.has(k)] + sorted(k for k in run.keys("timing/") if k not in TIMING_ORDER)
    if not keys:
        return "no `timing/*` metrics"
    parts = [[0.0 if math.isnan(v) else v for v in run.get(k)] for k in keys]
    labels = [k.removeprefix("timing/") for k in keys]
    if run.has("step_time"):  # whatever the phases do not cover (metrics, logging, ...)
        covered = [sum(col) for col in zip(*parts)]
        other = [max(0.0, t - c) if not math.isnan(t) else 0.0 for t, c in zip(run.get("step_time"), covered)]
        if any(o > 0 for o in other):
            parts.append(other)
            labels.append("other")
    if len(run.steps) <= MARKERS_MAX_POINTS:
        bottom = [0.0] * len(run.steps)
        for values, label in zip(parts, labels):
            ax.bar(run.steps, values, bottom=bottom, label=label, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
    else:
        ax.stackplot(run.steps, *parts, labels=labels, alpha=0.85)
    ax.set_title("Step time by phase")
    ax.set_ylabel("seconds")
    return None


def panel_eval(fig_or_ax, run: RunMetrics, single_ax: bool = False) -> str | None:
    keys = [k for k in run.keys("eval/") if k != "eval/num_prompts"]
    if not keys:
        return "no `eval/*` metrics (periodic evaluation was off)"
    groups: dict[str, list[str]] = {}
    for key in keys:  # eval/<reward>/<metric>: one subplot per reward
        name = key.split("/")[1] if key.count("/") >= 2 else "eval"
        groups.setdefault(name, []).append(key)
    if single_ax:  # the overview shows the weighted total only (per-reward curves are in eval.png)
        groups = {"reward": groups["reward"]} if "reward" in groups else groups
        axes = [fig_or_ax] * len(groups)
    else:
        axes = fig_or_ax.subplots(1, len(groups), squeeze=False)[0]
    for ax, (name, group) in zip(axes, groups.items()):
        for key in group:
            xs, ys = _present(run.steps, run.get(key))
            label = key.split("/")[-1]
            ax.plot(xs, ys, marker="o", markersize=4, label=label)
        ax.set_title(f"Eval: {'weighted total' if name == 'reward' else name}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return None


PANELS: list[tuple[str, Callable[..., str | None]]] = [
    ("reward", panel_reward),
    ("zero_std", panel_zero_std),
    ("completion_length", panel_length),
    ("kl", panel_kl),
    ("entropy", panel_entropy),
    ("clip_ratio", panel_clip),
    ("step_time", panel_step_time),
]


# ----------------------------------------------------------------------------- drawing


def plot_run(
    output_dir: str | Path, out_dir: str | Path | None = None, on_skip: Callable[[str], None] | None = None
) -> list[Path]:
    """Write the PNGs for OUTPUT_DIR/metrics.jsonl into `out_dir` (default OUTPUT_DIR/plots); return their paths.

    Panels without data are skipped; each skip is reported through `on_skip`
    (default: the `grpo_trainer` logger at INFO). Raises DataError when the
    metrics file is missing or empty, PlotDependencyError without matplotlib.
    """
    report = plot_metrics(read_run(output_dir), Path(out_dir) if out_dir is not None else Path(output_dir) / "plots")
    for panel, why in report.skipped.items():
        (on_skip or logger.info)(f"plot: skipped {panel}: {why}")
    return report.written


def plot_panel(run: RunMetrics, name: str, path: Path) -> str | None:
    """Panel `name` of PANELS alone, as the PNG `path` (the model card's reward curve is one); returns why it
    has nothing to draw, or None once written."""
    Figure = _figure_class()
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    why = dict(PANELS)[name](ax, run)
    if why is None:
        _finish(ax)
        _save(fig, path)
    return why


def plot_metrics(run: RunMetrics, out_dir: Path) -> PlotReport:
    Figure = _figure_class()
    out_dir.mkdir(parents=True, exist_ok=True)
    report = PlotReport()
    drawn: list[tuple[str, Callable[..., str | None]]] = []
    for name, panel in PANELS:
        why = plot_panel(run, name, out_dir / f"{name}.png")
        if why is None:
            report.written.append(out_dir / f"{name}.png")
            drawn.append((name, panel))
        else:
            report.skipped[name] = why

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    why = panel_eval(fig, run)
    if why is None:
        fig.set_size_inches(max(8, 5 * len(fig.axes)), 4.5)
        report.written.append(_save(fig, out_dir / "eval.png"))
    else:
        report.skipped["eval"] = why

    panels = drawn + ([("eval", lambda ax, r: panel_eval(ax, r, single_ax=True))] if why is None else [])
    if panels:
        cols = 2 if len(panels) > 1 else 1
        rows = math.ceil(len(panels) / cols)
        fig = Figure(figsize=(7 * cols, 3.6 * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, (name, panel) in zip(axes.flat, panels):
            panel(ax, run)
            if name != "eval":
                _finish(ax, legend_size=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(f"{len(run.steps)} logged steps (last: {int(run.steps[-1])})")
        report.written.append(_save(fig, out_dir / "overview.png"))
    if run.skipped_lines:
        report.skipped["(lines)"] = f"{run.skipped_lines} line(s) of metrics.jsonl were not valid JSON and were ignored"
    return report


def _finish(ax, legend_size: int = 8) -> None:
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size, loc="best")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def _figure_class():
    """matplotlib's Figure, imported on first use. Figures are drawn without pyplot, so no window or
    GUI backend is involved and the caller's global backend (e.g. in a notebook) is left alone: PNGs
    are rendered by the Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotDependencyError(
            "plotting needs matplotlib, an optional dependency: pip install 'grpo-trainer[plot]'"
        ) from None

    class AggFigure(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            FigureCanvasAgg(self)

    return AggFigure


def _present(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if not math.isnan(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _rolling_mean(ys: list[float], window: int) -> list[float]:
    """Centred moving average (the window shrinks at the ends), so the smooth curve does not lag the raw one."""
    half = window // 2
    prefix = [0.0]
    for y in ys:
        prefix.append(prefix[-1] + y)
    out = []
    for i in range(len(ys)):
        lo, hi = max(0, i - half), min(len(ys), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo_trainer.plot OUTPUT_DIR [--out DIR]`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="grpo_trainer.plot", description="Plot OUTPUT_DIR/metrics.jsonl to PNGs.")
    parser.add_argument("output_dir")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: OUTPUT_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.output_dir, args.out, on_skip=print)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
