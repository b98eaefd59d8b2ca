"""Run the tiny models' recipes and check that they give exactly the weights the package ships (or record them).

    python scripts/build_builtins.py           # check: build both, compare with grpo_trainer/builtin/weights/
    python scripts/build_builtins.py --write   # record: copy the builds' weights there, update manifest.json
    python scripts/build_builtins.py --only tiny-v5

Each recipe (grpo_trainer/builtin/tiny.py, tiny_tools.py) trains in build.CANONICAL_ENV (one thread, AVX2
kernels, MKL's COMPATIBLE branch), so any x86 machine gets the same bytes: ~6-7 minutes of one core each, the
builds side by side. `--write` is for a changed recipe: bump its VERSION first, so that caches assembled from
the old weights are not reused. The manifest also records the hash of a short build of each recipe
(`check_steps` steps), which tests/test_tiny.py compares against in every `make test`.

Prints one line per model and exits 1 when a build differs from what is shipped (without --write).
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

from grpo_trainer.builtin import tiny, tiny_tools  # noqa: E402
from grpo_trainer.builtin.build import MANIFEST, WEIGHTS_DIR, build_canonically, read_manifest, sha256_of  # noqa: E402

# folder name -> (recipe module, steps of the short build the tests repeat: ~10 s of one core each)
RECIPES = {tiny.FOLDER: (tiny, 30), tiny_tools.FOLDER: (tiny_tools, 10)}


def build(folder_name: str, out: Path, threads: int) -> dict:
    """Both builds of one recipe (full and short) into `out`; their hashes and the time they took.
    `threads` changes the time only (tests/test_tiny.py checks that the weights do not depend on it)."""
    module, check_steps = RECIPES[folder_name]
    builder = f"{module.__name__}:build_model"
    start = time.monotonic()
    build_canonically(builder, out / folder_name, threads=threads)
    seconds = time.monotonic() - start
    build_canonically(builder, out / f"{folder_name}-check", threads=threads, sft_steps=check_steps)
    return {
        "sha256": sha256_of(out / folder_name / "model.safetensors"),
        "check_steps": check_steps,
        "check_sha256": sha256_of(out / f"{folder_name}-check" / "model.safetensors"),
        "build_seconds": round(seconds),
    }


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
          f"torch {versions['torch']}, transformers {versions['transformers']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo-build-builtins-") as tmp, ThreadPoolExecutor(len(names)) as pool:
        out = Path(tmp)
        results = dict(zip(names, pool.map(lambda name: build(name, out, threads), names)))
        differ = []
        for name, built in results.items():
            shipped = manifest.get(name, {})
            same = all(shipped.get(k) == built[k] for k in ("sha256", "check_steps", "check_sha256"))
            differ += [] if same else [name]
            verdict = ("equal to" if same else "DIFFERENT from") if shipped else "no weights shipped yet, so none to compare with"
            print(f"{name}: built in {built['build_seconds']} s, sha256 {built['sha256'][:16]}..., {verdict}"
                  f"{' the shipped weights' if shipped else ''}", flush=True)
            if args.write:
                WEIGHTS_DIR.mkdir(exist_ok=True)
                shutil.copyfile(out / name / "model.safetensors", WEIGHTS_DIR / f"{name}.safetensors")
                recipe = RECIPES[name][0]
                manifest[name] = {**{k: built[k] for k in ("sha256", "check_steps", "check_sha256")},
                                  "sft_steps": recipe.SFT_STEPS, "built_with": versions}
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
