"""Run the tiny models' recipes and check that they give exactly the weights the package ships (or record them).

    python scripts/build_builtins.py           # check: build them all, compare with grpo_trainer/builtin/weights/
    python scripts/build_builtins.py --write   # record: copy the builds' weights there, update manifest.json
    python scripts/build_builtins.py --only tiny-v5
    python scripts/build_builtins.py --record-check   # short builds only: record this CPU's hashes (below)

Each recipe (grpo_trainer/builtin/tiny.py, tiny_tools.py, tiny_guess.py) trains in build.CANONICAL_ENV (one thread, AVX2
kernels, MKL's COMPATIBLE branch), so every x86 CPU of a kind gets the same bytes: ~6-7 minutes of one core
each, the builds side by side. `--write` is for a changed recipe: bump its VERSION first, so that caches
assembled from the old weights are not reused. The manifest also records the hash of a short build of each
recipe (`check_steps` steps), which tests/test_tiny.py compares against in every `make test`.

Not every kind of CPU computes the canonical arithmetic alike (an AMD EPYC gave other bytes than the Intel
Xeon that built the shipped weights: build.py). On such a CPU the full build cannot be compared with the
shipped weights; the short build then matches the hash recorded for that kind (`--record-check` records one:
run it where `make test`'s test_tiny fails on a recipe nobody changed, and say which CPU in the commit).

Prints one line per model and exits 1 when a build differs from every hash recorded (without --write).
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
from grpo_trainer.builtin.build import (MANIFEST, WEIGHTS_DIR, build_canonically, check_hashes,  # noqa: E402
                                         read_manifest, sha256_of)
from grpo_trainer.cpu.machine import cpu_info  # noqa: E402

# folder name -> (recipe module, steps of the short build the tests repeat: ~10 s of one core each)
RECIPES = {tiny.FOLDER: (tiny, 30), tiny_tools.FOLDER: (tiny_tools, 10), tiny_guess.FOLDER: (tiny_guess, 10)}


def build(folder_name: str, out: Path, threads: int, full: bool = True) -> dict:
    """Both builds of one recipe (full and short; the short one only without `full`) into `out`; their hashes
    and the time the full one took. `threads` changes the time only (tests/test_tiny.py checks that the
    weights do not depend on it)."""
    module, check_steps = RECIPES[folder_name]
    builder = f"{module.__name__}:build_model"
    built: dict = {"check_steps": check_steps}
    build_canonically(builder, out / f"{folder_name}-check", threads=threads, sft_steps=check_steps)
    built["check_sha256"] = sha256_of(out / f"{folder_name}-check" / "model.safetensors")
    if full:
        start = time.monotonic()
        build_canonically(builder, out / folder_name, threads=threads)
        built.update(sha256=sha256_of(out / folder_name / "model.safetensors"), build_seconds=round(time.monotonic() - start))
    return built


def this_cpu() -> str:
    """The manifest's name for the kind of CPU this is, e.g. "AMD EPYC (AVX-512 F/BW/VNNI/BF16), 2026-12-02"."""
    flags = set(cpu_info()["flags"])
    avx512 = [name for name, flag in (("F", "avx512f"), ("BW", "avx512bw"), ("VNNI", "avx512_vnni"),
                                      ("BF16", "avx512_bf16"), ("FP16", "avx512_fp16")) if flag in flags]
    vector = f"AVX-512 {'/'.join(avx512)}" if avx512 else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{cpu_info()['model']} ({vector}), {time.strftime('%Y-%m-%d')}"


def verdict(shipped: dict, built: dict) -> tuple[bool, str]:
    """Whether `built` agrees with the manifest entry `shipped`, and the line that says how."""
    if not shipped:
        return True, "no weights shipped yet, so none to compare with"
    recorded = check_hashes(shipped)
    building_cpu = next(iter(recorded))  # the one the shipped weights were built on
    same_recipe = shipped.get("check_steps") == built["check_steps"]
    kind = next((cpu for cpu, sha in recorded.items() if same_recipe and sha == built["check_sha256"]), None)
    if kind == building_cpu and built.get("sha256") == shipped["sha256"]:
        return True, "equal to the shipped weights"
    if kind is None:
        return False, "DIFFERENT from every hash recorded for the recipe: the recipe changed, or this CPU is a new kind"
    if kind == building_cpu:
        return False, f"short build as recorded, full build DIFFERENT from the shipped weights ({kind})"
    return True, (f"short build as recorded for {kind!r}: this kind of CPU computes the canonical arithmetic unlike "
                  "the one that built the shipped weights, so the full build cannot be compared with them here")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="record the builds as the shipped weights")
    parser.add_argument("--record-check", action="store_true",
                        help="short builds only; record their hashes as this kind of CPU's (check_sha256_other_cpus)")
    parser.add_argument("--only", choices=sorted(RECIPES), action="append", help="one model (repeatable)")
    args = parser.parse_args()
    if args.write and args.record_check:
        parser.error("--write records new weights (and drops other CPUs' hashes); --record-check only adds a hash")
    names = args.only or list(RECIPES)
    threads = max(1, (os.cpu_count() or 1) // len(names))
    manifest = {name: entry for name, entry in (read_manifest() if MANIFEST.is_file() else {}).items() if name in RECIPES}

    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    full = not args.record_check
    print(f"building {', '.join(names)} in the canonical settings ({threads} thread(s) each; "
          f"{'~6-7 min on one' if full else 'short builds only'}), on {this_cpu()}, "
          f"torch {versions['torch']}, transformers {versions['transformers']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo-build-builtins-") as tmp, ThreadPoolExecutor(len(names)) as pool:
        out = Path(tmp)
        results = dict(zip(names, pool.map(lambda name: build(name, out, threads, full), names)))
        differ = []
        for name, built in results.items():
            shipped = manifest.get(name, {})
            agrees, line = verdict(shipped, built)
            differ += [] if agrees else [name]
            took = f"built in {built['build_seconds']} s, sha256 {built['sha256'][:16]}..., " if full else ""
            print(f"{name}: {took}short build {built['check_sha256'][:16]}..., {line}", flush=True)
            if args.write:
                WEIGHTS_DIR.mkdir(exist_ok=True)
                shutil.copyfile(out / name / "model.safetensors", WEIGHTS_DIR / f"{name}.safetensors")
                recipe = RECIPES[name][0]
                manifest[name] = {**{k: built[k] for k in ("sha256", "check_steps", "check_sha256")},
                                  "sft_steps": recipe.SFT_STEPS, "built_with": versions, "built_on": this_cpu()}
            elif args.record_check and built["check_sha256"] not in check_hashes(shipped).values():
                if not shipped or shipped["check_steps"] != built["check_steps"]:
                    print(f"{name}: no shipped weights of this recipe to record a hash beside", file=sys.stderr)
                    return 1
                shipped.setdefault("check_sha256_other_cpus", {})[this_cpu()] = built["check_sha256"]
        if args.write or args.record_check:
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
