"""Run the tiny models' recipes and check that they give the weights the package ships (or record them).

    python scripts/build_builtins.py           # check: build them all, compare with grpo_trainer/builtin/weights/
    python scripts/build_builtins.py --write   # record: copy the builds' weights there, update manifest.json
    python scripts/build_builtins.py --only tiny-v5

Each recipe (grpo_trainer/builtin/tiny.py, tiny_tools.py, tiny_guess.py) trains in build.CANONICAL_ENV (one thread,
AVX2 kernels, MKL's COMPATIBLE branch), so every CPU of a kind gets the same bytes: ~6-7 minutes of one core each,
the builds side by side. `--write` is for a changed recipe: bump its VERSION first, so that caches assembled from
the old weights are not reused. It also records each recipe's short build (`check_steps` steps) and random start
in weights/checks/, which tests/test_tiny.py compares a short build with in every `make test`, within rounding.

Not every kind of CPU computes the canonical arithmetic alike (an AMD EPYC gave other bytes than the Intel Xeon
that built the shipped weights: build.py). The full build is equal to the shipped weights on the kind that built
them; elsewhere it cannot be, and the verdict rests on the short build, which lies within rounding of the
recorded one (build.check_distance) on any CPU unless the recipe changed. The line says which case this is, with
both distances.

Prints one line per model and exits 1 when a recipe no longer gives its weights (without --write).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_trainer.builtin import tiny, tiny_guess, tiny_tools  # noqa: E402
from grpo_trainer.builtin.build import (CHECK_TOLERANCE, MANIFEST, WEIGHTS_DIR, build_canonically,  # noqa: E402
                                         check_distance, read_manifest, record_check, sha256_of)
from grpo_trainer.cpu.machine import cpu_info  # noqa: E402

# folder name -> (recipe module, steps of the short build the tests repeat: ~10 s of one core each)
RECIPES = {tiny.FOLDER: (tiny, 30), tiny_tools.FOLDER: (tiny_tools, 10), tiny_guess.FOLDER: (tiny_guess, 10)}


def build(folder_name: str, out: Path, threads: int) -> dict:
    """The three builds of one recipe into `out` (its random start, its short build, the full one); the full
    build's hash and the time it took."""
    module, check_steps = RECIPES[folder_name]
    builder = f"{module.__name__}:build_model"
    for name, steps in (("initial", 0), ("check", check_steps)):
        build_canonically(builder, out / f"{folder_name}-{name}", threads=threads, sft_steps=steps)
    start = time.monotonic()
    build_canonically(builder, out / folder_name, threads=threads)
    return {"check_steps": check_steps, "sha256": sha256_of(out / folder_name / "model.safetensors"),
            "build_seconds": round(time.monotonic() - start)}


def this_cpu() -> str:
    """The manifest's name for the kind of CPU this is, e.g. "AMD EPYC (AVX-512 F/BW/VNNI/BF16), 2026-12-02"."""
    flags = set(cpu_info()["flags"])
    avx512 = [name for name, flag in (("F", "avx512f"), ("BW", "avx512bw"), ("VNNI", "avx512_vnni"),
                                      ("BF16", "avx512_bf16"), ("FP16", "avx512_fp16")) if flag in flags]
    vector = f"AVX-512 {'/'.join(avx512)}" if avx512 else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{cpu_info()['model']} ({vector}), {time.strftime('%Y-%m-%d')}"


def verdict(shipped: dict, built: dict, short_distance: float | None) -> tuple[bool, str]:
    """Whether the builds agree with the manifest entry `shipped`, and the line that says how.
    `short_distance`: the short build's distance from the recorded one (None: none recorded)."""
    if not shipped:
        return True, "no weights shipped yet, so none to compare with"
    if shipped.get("check_steps") != built["check_steps"] or short_distance is None:
        return False, "the short build's steps changed, or none is recorded: the recipe changed"
    short = f"short build {short_distance:.1e} from the recorded one (tolerance {CHECK_TOLERANCE:.0e})"
    if short_distance > CHECK_TOLERANCE:
        return False, f"DIFFERENT: {short}: the recipe changed"
    if built["sha256"] == shipped["sha256"]:
        return True, f"equal to the shipped weights; {short}"
    return True, (f"{short}, full build not bitwise the shipped weights: this kind of CPU rounds the canonical "
                  f"arithmetic unlike the one that built them ({shipped.get('built_on', 'unknown')})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="record the builds as the shipped weights")
    parser.add_argument("--only", choices=sorted(RECIPES), action="append", help="one model (repeatable)")
    args = parser.parse_args()
    names = args.only or list(RECIPES)
    threads = max(1, (os.cpu_count() or 1) // len(names))
    manifest = {name: entry for name, entry in (read_manifest() if MANIFEST.is_file() else {}).items() if name in RECIPES}

    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    print(f"building {', '.join(names)} in the canonical settings ({threads} thread(s) each; ~6-7 min on one), "
          f"on {this_cpu()}, torch {versions['torch']}, transformers {versions['transformers']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo-build-builtins-") as tmp, ThreadPoolExecutor(len(names)) as pool:
        out = Path(tmp)
        results = dict(zip(names, pool.map(lambda name: build(name, out, threads), names)))
        differ = []
        for name, built in results.items():
            shipped = manifest.get(name, {})
            short = out / f"{name}-check" / "model.safetensors"
            try:
                distance: float | None = check_distance(name, short)
            except FileNotFoundError:
                distance = None
            agrees, line = verdict(shipped, built, distance)
            differ += [] if agrees else [name]
            print(f"{name}: built in {built['build_seconds']} s, sha256 {built['sha256'][:16]}..., {line}", flush=True)
            if args.write:
                WEIGHTS_DIR.mkdir(exist_ok=True)
                shutil.copyfile(out / name / "model.safetensors", WEIGHTS_DIR / f"{name}.safetensors")
                record_check(name, out / f"{name}-initial" / "model.safetensors", short)
                manifest[name] = {"sha256": built["sha256"], "check_steps": built["check_steps"],
                                  "sft_steps": RECIPES[name][0].SFT_STEPS, "built_with": versions,
                                  "built_on": this_cpu(), "check_recorded_on": this_cpu()}
        if args.write:
            MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            print(f"recorded in {MANIFEST}")
            return 0
    if differ:
        print(f"the recipes of {', '.join(differ)} no longer give the shipped weights: if the change is meant, "
              "bump the recipe's VERSION and run this with --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
