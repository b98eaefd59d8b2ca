"""Where a training run's resident memory goes: RSS and glibc's allocator sampled every few milliseconds, by phase.

    python scripts/memory_timeline.py --model smollm2          # scripts/bench.py's SmolLM2 configuration, 4 steps
    python scripts/memory_timeline.py --model tiny --steps 3 --json timeline.json
    python scripts/memory_timeline.py --model smollm2 train.packing=true      # any config override after the options

It trains this trainer in-process on the --model preset's configuration (the one `scripts/bench.py` gives "ours")
while a thread samples, every --interval-ms: the resident set (/proc/self/statm) and glibc's `mallinfo2`: bytes in
use (heap chunks and mmapped blocks), bytes freed but kept in the heap, mmapped blocks, and the heap's size. The
trainer's phases (`metrics.PhaseTimer`), every backward pass and every optimizer step are marked, and the table
gives each segment's highest RSS with what the allocator held at that moment. Resident memory that is neither in
use nor free in the heap is the rest of the process: libraries, Python's own arenas, weights mapped from files.

Used for issue 26's memory goal (docs/performance.md, "Where the peak is"). `mallinfo2` takes the allocator's
locks, so the run is slower than without the sampler: the times here are not step times. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class Sampler:
    """RSS and allocator state every `interval` seconds on a daemon thread, plus named marks, all in MiB."""

    FIELDS = ("t", "rss", "file_backed", "in_use", "free_in_heap", "mmapped", "heap")

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: list[tuple] = []
        self.marks: list[tuple[float, str]] = []
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _MallInfo2
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple:
        with open("/proc/self/statm") as f:
            _, resident, shared, *_ = (int(n) * self._page for n in f.read().split())
        info = self._libc.mallinfo2()
        return (time.perf_counter(), resident / MIB, shared / MIB, (info.uordblks + info.hblkhd) / MIB,
                info.fordblks / MIB, info.hblkhd / MIB, info.arena / MIB)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            time.sleep(self.interval)

    def mark(self, name: str) -> None:
        self.marks.append((time.perf_counter(), name))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def marked_training(sampler: Sampler):
    """Marks phases, backward passes and optimizer steps while the block runs (patches undone afterwards)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from grpo_trainer import metrics

    phase, backward = metrics.PhaseTimer.phase, torch.Tensor.backward

    @contextlib.contextmanager
    def marked_phase(self, name):
        sampler.mark(f"{name.removeprefix('timing/')} start")
        with phase(self, name):
            yield
        sampler.mark(f"{name.removeprefix('timing/')} end")

    def marked_backward(self, *args, **kwargs):
        sampler.mark("backward start")
        try:
            return backward(self, *args, **kwargs)
        finally:
            sampler.mark("backward end")

    hooks = [register_optimizer_step_pre_hook(lambda *a: sampler.mark("optimizer step start")),
             register_optimizer_step_post_hook(lambda *a: sampler.mark("optimizer step end"))]
    metrics.PhaseTimer.phase, torch.Tensor.backward = marked_phase, marked_backward
    try:
        yield
    finally:
        metrics.PhaseTimer.phase, torch.Tensor.backward = phase, backward
        for hook in hooks:
            hook.remove()


def segments(sampler: Sampler) -> list[dict]:
    """From each mark to the next: the highest RSS and what the allocator held then."""
    rows, marks = [], sampler.marks + [(float("inf"), "")]
    t0 = sampler.samples[0][0]
    for (start, name), (end, _) in zip(marks, marks[1:]):
        inside = [s for s in sampler.samples if start <= s[0] < end]
        if inside:
            top = dict(zip(Sampler.FIELDS, max(inside, key=lambda s: s[1])))
            rows.append({"from": name, "at_s": round(top.pop("t") - t0, 2), **{k: round(v) for k, v in top.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(bench.PRESETS), default="smollm2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=None, help="write every sample and mark here")
    args, overrides = p.parse_known_args(argv)
    stray = [o for o in overrides if "=" not in o]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)} (config overrides are KEY=VALUE)")

    from grpo_trainer import train
    from grpo_trainer.config import config_from_dict

    with tempfile.TemporaryDirectory(prefix="grpo-memory-") as tmp:
        root = Path(tmp)
        spec = bench.spec_of(bench.PRESETS[args.model], bench.model_path(args.model, root), steps=args.steps,
                             ours_overrides=overrides)
        cfg = config_from_dict(bench.ours_config(spec, root / "run"), source=f"the {args.model} bench config")
        with Sampler(args.interval_ms / 1e3) as sampler, marked_training(sampler):
            sampler.mark("start")
            train(cfg)

    import machine

    rows = segments(sampler)
    peak = max(rows, key=lambda r: r["rss"])
    print(f"machine: {machine.one_line(machine.describe(measure=False))}")
    print(f"model={args.model} steps={args.steps} overrides={overrides or 'none'}; MiB; each row: the highest RSS "
          "from its mark to the next, and the allocator then")
    print("| from | at (s) | RSS | file-backed | in use | free in heap | mmapped | heap |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        bold = "**" if r is peak else ""
        print(f"| {r['from']} | {r['at_s']} | {bold}{r['rss']}{bold} | {r['file_backed']} | {r['in_use']} | "
              f"{r['free_in_heap']} | {r['mmapped']} | {r['heap']} |")
    rest = peak["rss"] - peak["in_use"] - peak["free_in_heap"]
    print(f"peak {peak['rss']} MiB ({peak['from']}, {peak['at_s']} s): {peak['in_use']} in use, {peak['free_in_heap']} "
          f"freed but kept in the heap, {rest} neither (libraries, Python's arenas, file-mapped weights)")
    if args.json:
        args.json.write_text(json.dumps({"fields": Sampler.FIELDS, "samples": sampler.samples, "marks": sampler.marks,
                                         "segments": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
