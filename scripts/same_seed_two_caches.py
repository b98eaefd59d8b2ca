"""One config and seed, two fresh caches: the same run? (Reproducibility: a run's samples are a function of its
config, its seed and the machine, whatever any cache holds.)

    python scripts/same_seed_two_caches.py configs/smollm2_cpu.yaml seed=11 rollout.max_completion_length=96 \
        train.prompts_per_step=4 train.max_steps=3

Run A trains straight through on a fresh `GRPO_TRAINER_CACHE`. Run B starts on another fresh cache, is killed
with SIGKILL from outside as soon as its step-1 checkpoint is published, and resumes (`checkpoint.resume=auto`)
on the same second cache. Both caches start empty but for the model folders (linked from the usual cache, so the
model is not converted twice): every kernel decision is made afresh in each. The script prints each step's
metrics side by side and whether the final weights are bit-identical; it exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_trainer.builtin.build import cache_dir  # noqa: E402

COMPARED = ("reward", "completions/mean_length", "loss", "grad_norm")


def fresh_cache(folder: Path) -> Path:
    """An empty cache but for links to the model folders the usual cache holds (nothing else: no kernel plan)."""
    folder.mkdir(parents=True)
    for model in cache_dir().iterdir() if cache_dir().is_dir() else ():
        if model.is_dir() and (model / "config.json").is_file():
            (folder / model.name).symlink_to(model)
    return folder


def train(config: str, overrides: list[str], out: Path, cache: Path, kill_after_step: int = 0) -> None:
    command = [sys.executable, "-m", "grpo_trainer", "train", config, *overrides, f"output_dir={out}",
               "checkpoint.save_every=1", "checkpoint.resume=auto"]
    env = {**os.environ, "GRPO_TRAINER_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    log = open(out.parent / f"{out.name}.log", "a")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if kill_after_step:
        published = out / "checkpoints" / f"step-{kill_after_step:06d}"
        while process.poll() is None and not published.is_dir():
            time.sleep(0.05)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            print(f"{out.name}: killed -9 once {published.name} was published", flush=True)
            return
    if process.wait() != 0:
        raise SystemExit(f"{out.name}: train exited {process.returncode}; see {out.parent / out.name}.log")


def metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row for row in rows if "step" in row and "reward" in row}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="same-seed-") as tmp:
        base = Path(tmp)
        a, b = base / "straight", base / "killed_and_resumed"
        started = time.monotonic()
        train(args.config, args.overrides, a, fresh_cache(base / "cache_a"))
        train(args.config, args.overrides, b, fresh_cache(base / "cache_b"), kill_after_step=1)
        train(args.config, args.overrides, b, base / "cache_b")
        ma, mb = metrics(a), metrics(b)
        for step in sorted(ma):
            cells = "  ".join(f"{k} {ma[step].get(k)!r:>22} {mb.get(step, {}).get(k)!r:>22}" for k in COMPARED)
            print(f"step {step}: {cells}")
        plans = [json.loads((out / "decode_kernels.json").read_text())["choices"] for out in (a, b)]
        wa, wb = (load_file(out / "model" / "model.safetensors") for out in (a, b))
        same_weights = wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
        same_metrics = all(ma[s].get(k) == mb.get(s, {}).get(k) for s in ma for k in COMPARED)
        print(f"kernel plans {'equal' if plans[0] == plans[1] else 'DIFFERENT'} ({len(plans[0])} decisions); "
              f"metrics {'equal' if same_metrics else 'DIFFERENT'}; final weights "
              f"{'bit-identical' if same_weights else 'DIFFERENT'}; {time.monotonic() - started:.0f} s in all")
        return 0 if same_weights and same_metrics else 1


if __name__ == "__main__":
    sys.exit(main())
