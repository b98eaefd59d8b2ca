"""Building a built-in model once per machine: the cache, the lock, the staging folder, the canonical float
settings, and the shipped weights of the trained tiny models.

Every built-in model is a folder under the cache (`$GRPO_TRAINER_CACHE`, default `~/.cache/grpo_trainer`)
named with its recipe's version (`tiny-v3`), so a changed recipe builds a new folder instead of reusing a
stale one. `cached_build` is the one way such a folder comes to exist: built in a staging folder beside it
and renamed into place, by one process per machine while the others (ranks, parallel tests) wait on a lock.

Why the tiny models' weights are shipped (weights/, 3.4 MB): their recipes (tiny.py, tiny_tools.py, tiny_guess.py) train
them in the canonical float settings below, which make every machine of a kind (Intel, AMD: see below) get
the same weights but run on one core at SSE2 speed: minutes on every fresh machine before a demo or a test
could start (docs/performance.md, "The demo, the install and the test suite"). The package ships what those recipes produce instead, with its sha256 in weights/manifest.json;
a fresh machine assembles the folder from them in a second (`assembled_from_shipped_weights`: the same code, the warm start replaced by
loading the weights). `scripts/build_builtins.py` runs the recipes and checks (or, with --write, records)
that they give exactly the shipped bytes (on the kind of CPU that built them); tests/test_tiny.py checks each
recipe's first steps against a recorded short build, within rounding, on any CPU, so a changed recipe cannot go
unnoticed beside stale weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHTS_DIR = Path(__file__).parent / "weights"
MANIFEST = WEIGHTS_DIR / "manifest.json"


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_TRAINER_CACHE", Path.home() / ".cache" / "grpo_trainer"))


def cached_build(folder_name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir() / folder_name`, first built by `build(staging_folder)` if this machine has none.

    Safe under races: one builder per machine (a file lock beside the folder); the others wait and then find
    the folder. Atomic: the build writes into a staging folder that is renamed into place when complete, so a
    crash or a failure mid-build leaves nothing half-built (the staging folder is removed).
    """
    target = cache_dir() / folder_name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{folder_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # built by another process while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{folder_name}-building-", dir=target.parent))
        try:
            build(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


# The build's float arithmetic, made the same on every x86 machine: ATen's AVX2 kernels even where AVX-512 is
# there (the two sum in different orders; vector IEEE arithmetic is the same on any AVX2 CPU), MKL's
# bitwise-reproducible COMPATIBLE branch (SSE2 without the approximate rcpps/rsqrtps), one thread, no oneDNN.
# COMPATIBLE is the only reproducible branch MKL honours on CPUs of every vendor: its documentation says the
# others (AVX2, AVX512, ...) are "available only for Intel processors", and elsewhere MKL silently takes its
# AUTO branch. Version 3 used MKL_CBWR=AVX2: built on an AMD EPYC and on an Intel Xeon, its weights differed
# (the Xeon's warm start scored mean@4 0.06 on the held-out sums, the EPYC's 0.25), and so did every golden
# number. COMPATIBLE is not enough either: on an AMD EPYC with AVX-512 the short builds of both
# recipes gave other bytes than on the Xeon that built the shipped weights, the same on 1 and 2 threads and
# with MKL held to AVX2, so the difference is the CPU's, not the settings' (where exactly is not isolated:
# ATen's elementwise kernels gave the same bytes under every capability there; MKL's sgemm is the suspect).
# Hence the weights are shipped, and the tests compare a short build with a recorded one within a tolerance
# that rounding cannot reach and a changed recipe cannot stay under (the recipe check, below). A child process,
# since these settings are read when torch starts.
CANONICAL_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def build_canonically(builder: str, folder: Path, threads: int = 1, prelude: str = "", **kwargs: int) -> None:
    """Call `builder` ("module:function", which takes the folder and `kwargs`) in a child process with
    `CANONICAL_ENV`, so the model it trains is the same on every machine of a kind. `threads` is there for the
    test that the result does not depend on it (tests/test_tiny.py); builds use one. `prelude`: Python run in the
    child before the build (the tests simulate another CPU or a changed recipe with it)."""
    module, function = builder.split(":")
    code = (
        f"import sys, torch; torch.set_num_threads({int(threads)}); torch.backends.mkldnn.enabled = False; "
        f"{prelude}\n"
        f"from pathlib import Path; from {module} import {function}; {function}(Path(sys.argv[1]), **{kwargs!r})"
    )
    env = {**os.environ, **CANONICAL_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    result = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {builder} into {folder} failed:\n{result.stderr[-3000:]}")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest() -> dict[str, dict]:
    """weights/manifest.json: for each shipped model folder name (`tiny-v5`), the sha256 of its weights, how
    and where they were built, and the hashes a short build of its recipe (`check_steps` steps) gives
    (`check_hashes`)."""
    return json.loads(MANIFEST.read_text())


# ----------------------------------------------------------------------------- the recipe check
#
# `make test` cannot afford a full build (minutes of one core per recipe), so it repeats each recipe's first
# `check_steps` steps and compares the weights with the ones recorded in weights/checks/. Bits cannot be the
# comparison: another kind of CPU rounds the canonical arithmetic differently (an AMD EPYC and an Intel Xeon
# did), and the next CI machine may be a kind nobody has recorded. So the check measures how far the short
# build lies from the recorded one, relative to how far the recorded one moved from its random start:
#
#     distance = ||w - w_recorded|| / ||w_recorded - w_initial||        (over `CHECK_SAMPLES` fixed coordinates)
#
# Rounding differs in the last bits of each operation; a changed recipe changes every update. Measured on the
# three recipes (tests/test_tiny.py repeats it in every `make test`): a simulated other CPU (every weight nudged
# by one ulp, up or down at random, after every optimizer step: more than reordered sums change) lies 1-3e-6
# away; the smallest recipe change tried, the learning rate x1.01, 1-4e-2. `CHECK_TOLERANCE` sits between them,
# 400x above the one and 10x below the other. (Over a full build the gap between CPUs does not stay small:
# training amplifies it, and the AMD EPYC's full tiny build lies far from the Xeon's, so full builds are only
# compared bitwise, on the kind that built them: scripts/build_builtins.py.)
CHECKS_DIR = WEIGHTS_DIR / "checks"
CHECK_SAMPLES = 8192
CHECK_TOLERANCE = 1e-3


def check_file(folder_name: str) -> Path:
    return CHECKS_DIR / f"{folder_name}.safetensors"


def sampled_weights(weights: Path) -> Any:
    """`CHECK_SAMPLES` coordinates of a `model.safetensors`, evenly spaced over its tensors in name order,
    as float64 (the distance is then computed without rounding of its own)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(weights)
    flat = torch.cat([tensors[name].reshape(-1).double() for name in sorted(tensors)])
    return flat[torch.linspace(0, flat.numel() - 1, CHECK_SAMPLES).round().long()]


def record_check(folder_name: str, initial: Path, trained: Path) -> Path:
    """Write the check of `folder_name`: the sampled weights of its recipe's random start (`initial`, a
    `model.safetensors` built with no steps) and of its short build (`trained`)."""
    from safetensors.torch import save_file

    CHECKS_DIR.mkdir(parents=True, exist_ok=True)
    samples = {"initial": sampled_weights(initial).float(), "trained": sampled_weights(trained).float()}  # exact
    save_file(samples, check_file(folder_name))
    return check_file(folder_name)


def check_distance(folder_name: str, built: Path) -> float:
    """How far the short build `built` (a `model.safetensors`) lies from the recorded one, relative to the
    recorded build's distance from its random start (see above); at most `CHECK_TOLERANCE` for the same recipe
    on any CPU."""
    from safetensors.torch import load_file

    path = check_file(folder_name)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no recorded check for builtin {folder_name!r}; "
            "python scripts/build_builtins.py --write records one"
        )
    recorded = {name: values.double() for name, values in load_file(path).items()}
    moved = (recorded["trained"] - recorded["initial"]).norm()
    return float((sampled_weights(built) - recorded["trained"]).norm() / moved)


def nudge_after_every_step(seed: int = 0) -> None:
    """Simulate a CPU that rounds differently (for the tests of the check above): after every optimizer step
    of this process, move every parameter by one ulp, up or down at random."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    generator = torch.Generator().manual_seed(seed)

    def nudge(optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    up = torch.rand(p.shape, generator=generator) < 0.5
                    toward = torch.where(up, torch.inf, -torch.inf).to(p.dtype)
                    p.copy_(torch.nextafter(p, toward))

    register_optimizer_step_post_hook(nudge)


def shipped_weights(folder_name: str) -> Path:
    """The shipped `model.safetensors` of `folder_name` (`tiny-v5`), checked against the manifest's sha256.

    A missing or altered file (a partial checkout, a Git LFS pointer, a hand edit) is an error naming it,
    never silently different weights: the golden metrics and the README's demo numbers depend on them.
    """
    path = WEIGHTS_DIR / f"{folder_name}.safetensors"
    entry = read_manifest().get(folder_name)
    rebuild = "python scripts/build_builtins.py --write rebuilds it from its recipe"
    if entry is None:
        raise FileNotFoundError(f"{MANIFEST} has no entry for {folder_name!r}; {rebuild}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the shipped weights of builtin {folder_name!r} are missing; {rebuild}")
    if sha256_of(path) != entry["sha256"]:
        raise ValueError(
            f"{path}: not the weights {MANIFEST.name} records for {folder_name!r} (sha256 differs); "
            f"restore it from the repository, or {rebuild}"
        )
    return path


def assembled_from_shipped_weights(folder_name: str, build_model: Callable[..., None]) -> Path:
    """The cache folder of a shipped model (`tiny-v5`), assembled first where this machine has none:
    `build_model(folder, weights=...)`, its recipe's builder given the shipped weights instead of training."""
    return cached_build(folder_name, lambda folder: build_model(folder, weights=shipped_weights(folder_name)))


def load_weights(path: Path) -> Callable[[Any], None]:
    """A warm start that loads `path` (a `model.safetensors`) into the model instead of training it.

    The file is what `save_pretrained` wrote, so a tied output head is absent from it and tied again here;
    any other key missing or left over is an error (the shape or the names changed since it was built)."""

    def load(model) -> None:
        from safetensors.torch import load_file

        misfit = f"{path} does not fit the model its recipe builds"
        try:
            missing, unexpected = model.load_state_dict(load_file(path), strict=False)
        except RuntimeError as exc:  # a tensor of another shape
            raise ValueError(f"{misfit}: {str(exc).splitlines()[-1].strip()}") from None
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{misfit}: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        model.tie_weights()

    return load
