"""What the model card adds to a run: its wall time, against the run's own, in fresh processes.

    python scripts/model_card_cost.py [--reps 3] [--out /tmp/card_cost] [CONFIG] [OVERRIDES...]

Trains CONFIG (default configs/demo_cpu.yaml, what `make demo` runs) once per rep in a fresh process, timing the
whole command; after each, writes the card for that run again in a fresh process that has imported what the
trainer has imported by then (so matplotlib's import, the card's main cost, is paid cold, as in the run).
Prints both medians and their ratio. The run's time already includes one card: the ratio is the card's share.
No timed assertion anywhere: this prints numbers for people.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARD_ONLY = """
import sys, time
import grpo_trainer.trainer  # imported by the trainer before its final save
from accelerate import Accelerator
from grpo_trainer.config import load_config
from grpo_trainer.model_card import setup_of, write_model_card
out = sys.argv[1]
setup = setup_of(Accelerator(cpu=True))
started = time.perf_counter()
write_model_card(f"{out}/model", load_config(f"{out}/config.yaml"), out, setup)
print(time.perf_counter() - started)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="/tmp/grpo_card_cost")
    args = parser.parse_args()
    runs, cards = [], []
    for rep in range(args.reps):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "grpo_trainer", "train", args.config, f"output_dir={args.out}",
                        "logging.progress_bar=false", "checkpoint.resume=never", *args.overrides],
                       cwd=ROOT, check=True, capture_output=True)
        runs.append(time.perf_counter() - started)
        card = subprocess.run([sys.executable, "-c", CARD_ONLY, args.out], cwd=ROOT, check=True, capture_output=True, text=True)
        cards.append(float(card.stdout.strip().splitlines()[-1]))
        print(f"rep {rep + 1}: run {runs[-1]:.1f} s, card {cards[-1]:.2f} s", flush=True)
    run, card = statistics.median(runs), statistics.median(cards)
    print(f"median: run {run:.1f} s (card included), card {card:.2f} s: {100 * card / run:.1f}% of the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
