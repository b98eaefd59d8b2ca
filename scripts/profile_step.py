"""Where a training step's time goes: torch profiler over a few steps of the bench configuration.

    python scripts/profile_step.py                    # tiny model, the `make bench` configuration
    python scripts/profile_step.py --model large      # ~25M-parameter random-init Llama
    python scripts/profile_step.py --share-prompt false   # the same without the shared-prompt paths
    python scripts/profile_step.py --trace trace.json     # also a Chrome/Perfetto trace

It trains this trainer in-process (same config as `scripts/bench.py`'s `_run_ours`) and profiles
steps 3.. (the first two pay one-off start-up: reward workers, allocator warm-up). It prints:
  1. the step's phases (`timing/*` in metrics.jsonl, medians over the profiled steps);
  2. per phase (the trainer marks each with `torch.profiler.record_function`), the operators that
     take the most self CPU time inside it;
and first the machine it ran on (scripts/machine.py), load average included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

PHASES = ["timing/rollout", "timing/reward", "timing/logprobs", "timing/update", "timing/weight_sync"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(bench.PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=6, help="steps to run; the first 2 are not profiled")
    p.add_argument("--prompts-per-step", type=int, default=None, help="default: the --model preset's")
    p.add_argument("--num-generations", type=int, default=None, help="default: the --model preset's")
    p.add_argument("--share-prompt", choices=["true", "false"], default="true")
    p.add_argument("--skip-zero-advantage", choices=["true", "false"], default="true",
                   help="false to profile the full update (the random-init large model's advantages are all 0)")
    p.add_argument("--top", type=int, default=8, help="operators shown per phase")
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    args = p.parse_args(argv)

    import torch

    from grpo_trainer.config import config_from_dict
    from grpo_trainer import train

    if args.steps < 3:
        p.error("--steps must be at least 3 (the first 2 are not profiled)")
    preset = dict(bench.PRESETS[args.model])
    for key in ("prompts_per_step", "num_generations"):
        preset[key] = getattr(args, key) or preset[key]
    preset["micro_batch_size"] = min(preset["micro_batch_size"], preset["prompts_per_step"] * preset["num_generations"])
    with tempfile.TemporaryDirectory(prefix="grpo-profile-") as tmp:
        root = Path(tmp)
        spec = bench.spec_of(preset, bench.model_path(args.model, root), steps=args.steps,
                             share_prompt=args.share_prompt == "true", skip_zero_advantage=args.skip_zero_advantage == "true")
        cfg = config_from_dict(bench.ours_config(spec, root / "run"))
        schedule = torch.profiler.schedule(wait=0, warmup=2, active=args.steps - 2, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
            train(cfg, on_step_end=lambda step: prof.step())
        rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()][2:]
        if args.trace:
            prof.export_chrome_trace(str(args.trace))

    import machine

    step = statistics.median(r["step_time"] for r in rows)
    print(f"machine: {machine.one_line(machine.describe(measure=False))}")
    print(f"model={args.model} share_prompt={args.share_prompt} profiled steps={len(rows)} median step {step:.3f} s")
    print("| phase | median s | share of step |\n|---|---|---|")
    for key in PHASES:
        if key in rows[0]:
            t = statistics.median(r[key] for r in rows)
            print(f"| {key.removeprefix('timing/')} | {t:.3f} | {100 * t / step:.0f}% |")

    # Operators inside each phase: events nested under the phase's record_function range.
    events = prof.events()
    phases = [e for e in events if e.name in PHASES]
    by_phase: dict[str, dict[str, float]] = {name: {} for name in PHASES}
    for e in events:
        if e.name in PHASES or not e.name.startswith("aten::"):
            continue
        start, end = e.time_range.start, e.time_range.end
        owner = next((ph.name for ph in phases if ph.time_range.start <= start and end <= ph.time_range.end
                      and ph.thread == e.thread), None)
        if owner:
            by_phase[owner][e.name] = by_phase[owner].get(e.name, 0.0) + e.self_cpu_time_total / 1e3
    for name, ops in by_phase.items():
        if not ops:
            continue
        total = sum(ops.values())
        top = sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]
        print(f"\n{name.removeprefix('timing/')}: aten self time {total:.0f} ms over {len(rows)} steps; top operators")
        for op, ms in top:
            print(f"  {op:45s} {ms:8.1f} ms  {100 * ms / total:4.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
