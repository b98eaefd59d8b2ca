"""Which of the decode loop's alternative kernels runs: decided once, before a run samples anything.

The decode loop has alternatives that compute the same thing (decode.py: the linear form, the attention
path, a Llama's step; cpu/draw.py: the multinomial draw). Which is faster depends on the CPU, its vector units,
the BLAS build and the shapes. But not all of them give the same bits: the linear forms, attention paths and
steps sum in different orders, the draws are exact. A run's samples must be a function of its config, its seed and the machine, never
of a timing (two fresh caches timing a near tie would otherwise give two runs of one seed), so:
* A decision whose alternatives round differently is made by a rule (`by_rule`): of the machine (what can run
  here), the model's shapes and dtype (decode.py's `DecodeKernels.preferred`), or the user
  (`GRPO_TRAINER_DECODE_KERNELS`, below). Never by timing.
* A decision whose alternatives are exact (the draws) is timed where it runs, per shape: every alternative a
  few times, alternating, the best time of each kept (the least disturbed on a busy machine), and the fastest
  wins (`KernelTable.decide`). Whatever it picks, the samples are the same.
* Every decision a run can reach (each linear shape at every row bucket up to the run's largest batch, each
  attention shape at every context bucket up to its longest sequence, each draw) is decided *before* the run
  samples anything, as one plan (`decode.plan_decode_kernels`, made by the hf engine for the reach it is built
  with: kernel_plan.py); the decode loop only looks its choices up and never measures (a shape the plan lacks runs the incumbent). Timing runs under `fork_rng` with its own
  generators: it never moves the run's random stream.
* A timed decision is cached in `decode_kernels.json` beside the model cache, keyed by what decides speed: the
  CPU model and its flags (or the GPU's name), ATen's CPU capability, torch's version and thread count; then by
  decision and shape. A cached choice is final. `python -m grpo_trainer kernels CONFIG --remeasure` times the
  config's timed decisions again and says which changed (the speed only).
* The plan is recorded in the run's output folder (`decode_kernels.json`) and in every checkpoint; a resume
  uses the recorded plan, whatever this machine's rule or cache says (an alternative not available here is
  replaced, with one warning line).

Two rules keep the timing honest:
* A decision is timed only where it can matter (`worth_measuring`, decided by the caller). Below that a
  kernel class costs microseconds per step, the timings are noise, and the incumbent (the first
  alternative) stays.
* An alternative replaces the incumbent only when it is at least `MARGIN` faster.

`GRPO_TRAINER_DECODE_KERNELS="linear=weight_stationary,attention=repeated,draw=native,step=modules"` forces choices
(the tests do so to check every alternative); an unknown name is an error naming the choices.
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..cpu.machine import cpu_info
from ..errors import ConfigError

logger = logging.getLogger(__name__)

FORCE_ENV = "GRPO_TRAINER_DECODE_KERNELS"
CACHE_FILE = "decode_kernels.json"
CACHE_VERSION = 1
MIN_WORK_BYTES = 16 * 2**20  # weights or KV cache a kernel class reads per decode step, below which it stays
MIN_DRAW_ELEMENTS = 2**16  # rows x vocabulary of a draw worth timing
MARGIN = 0.10
REPS = 5


def row_bucket(rows: int) -> int:
    """Rows are measured in powers of two (16, 8, 4, ...): rows leave the batch as completions finish."""
    return 1 << max(0, rows - 1).bit_length()


def length_bucket(length: int) -> int:
    """Context lengths, in powers of two from 64."""
    return max(64, 1 << max(0, length - 1).bit_length())


# ----------------------------------------------------------------------------- the machine


def machine_fingerprint(device_type: str = "cpu") -> dict[str, Any]:
    """What decides which kernel is fastest here (and what a performance number holds for)."""
    fingerprint: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if device_type == "cuda":
        fingerprint["gpu"] = torch.cuda.get_device_name()
        return fingerprint
    cpu = cpu_info()
    fingerprint.update(
        cpu=cpu["model"],
        flags_sha256=hashlib.sha256(" ".join(cpu["flags"]).encode()).hexdigest()[:16],
        capability=torch.backends.cpu.get_cpu_capability(),
    )
    return fingerprint


def machine_key(device_type: str) -> str:
    return hashlib.sha256(json.dumps(machine_fingerprint(device_type), sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- timing


def time_alternatives(
    candidates: dict[str, Callable[[], Any]], reps: int = REPS, device_type: str = "cpu"
) -> dict[str, float]:
    """Best milliseconds of each candidate over `reps` alternating rounds (after one warm-up call each);
    the global random state is left as it was (the draw alternatives consume it)."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    best = {name: float("inf") for name in candidates}
    names = list(candidates)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name in names:
            candidates[name]()
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each goes first in turn
                sync()
                start = time.perf_counter()
                candidates[name]()
                sync()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


# ----------------------------------------------------------------------------- the table


class KernelTable:
    """Measured choices for this machine: in memory, backed by a JSON file (`path`; None: memory only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._choices: dict[str, dict] | None = None

    def decide(
        self,  # only for decisions whose alternatives give the same bits (kernels.py says why)
        decision: str,
        shape: tuple[int, ...],
        alternatives: list[str],
        measure: Callable[[], dict[str, Callable[[], Any]]],
        worth_measuring: bool,
        device_type: str = "cpu",
        remeasure: bool = False,
    ) -> str:
        """The alternative to run for `decision` at `shape`: forced, the incumbent (alternatives[0]) where the
        work is too small to matter, cached, or measured now (`measure()` builds the timed calls; it and the
        timing run with the global random state saved and restored). `remeasure`: time it again even if cached.
        Called while a run is planned, never while it samples."""
        forced = forced_choice(decision, alternatives)
        if forced is not None:
            return forced
        if len(alternatives) == 1 or not worth_measuring:
            return alternatives[0]
        key = f"{machine_key(device_type)}/{decision}/{'x'.join(map(str, shape))}"
        entry = self._load().get(key)
        # A choice made before an alternative was added (or without one that is gone) is measured again.
        if entry is not None and set(entry.get("ms", ())) == set(alternatives) and not remeasure:
            return entry["choice"]
        with torch.random.fork_rng(devices=[]):
            ms = time_alternatives(measure(), device_type=device_type)
        incumbent = alternatives[0]
        fastest = min(ms, key=ms.__getitem__)
        choice = fastest if ms[fastest] < (1 - MARGIN) * ms[incumbent] else incumbent
        self._store(
            key,
            {
                "choice": choice,
                "ms": {k: round(v, 4) for k, v in ms.items()},
                "loadavg": round(os.getloadavg()[0], 2),
                "measured": datetime.datetime.now().isoformat(timespec="seconds"),
                "machine": machine_fingerprint(device_type),
            },
        )
        logger.info(
            "decode kernels: %s at %s -> %s (%s ms)",
            decision,
            shape,
            choice,
            ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
        )
        return choice

    def entries(self) -> dict[str, dict]:
        return dict(self._load())

    def _load(self) -> dict[str, dict]:
        if self._choices is None:
            self._choices = self._read()
        return self._choices

    def _read(self) -> dict[str, dict]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            logger.warning("decode kernels: %s is unreadable; measuring again", self.path)
            return {}
        return data.get("choices", {}) if data.get("version") == CACHE_VERSION else {}

    def _store(self, key: str, entry: dict) -> None:
        self._load()[key] = entry
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "w") as lock:  # several processes may measure at once
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**self._read(), key: entry}
                with tempfile.NamedTemporaryFile(
                    "w", dir=self.path.parent, prefix=".decode_kernels-", delete=False
                ) as tmp:
                    json.dump({"version": CACHE_VERSION, "choices": merged}, tmp, indent=1, sort_keys=True)
                os.replace(tmp.name, self.path)
            self._choices = merged
        except OSError as exc:  # a read-only cache costs a re-measurement next time, nothing else
            logger.warning("decode kernels: could not write %s (%s)", self.path, exc)


@functools.lru_cache(maxsize=1)
def default_table() -> KernelTable:
    from ..builtin import cache_dir

    return KernelTable(cache_dir() / CACHE_FILE)


def by_rule(decision: str, alternatives: list[str], preferred: str | None) -> str:
    """A decision whose alternatives round differently: the user's forced choice, else `preferred` where it can
    run here, else the incumbent (alternatives[0]). Nothing is timed (kernels.py says why)."""
    forced = forced_choice(decision, alternatives)
    if forced is not None:
        return forced
    return preferred if preferred in alternatives else alternatives[0]


def forced_choice(decision: str, alternatives: list[str]) -> str | None:
    """The alternative `GRPO_TRAINER_DECODE_KERNELS` forces for `decision`, if any; one that cannot run here is
    an error naming those that can."""
    forced = forced_choices().get(decision)
    if forced is not None and forced not in alternatives:
        raise ConfigError(f"{FORCE_ENV}: {decision}={forced!r} is not available here; choose from {alternatives}")
    return forced


def forced_choices() -> dict[str, str]:
    """`GRPO_TRAINER_DECODE_KERNELS="decision=alternative,..."` as a dict."""
    spec = os.environ.get(FORCE_ENV, "").strip()
    forced = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        decision, sep, name = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{FORCE_ENV}: {item!r} is not decision=alternative (e.g. linear=weight_stationary)")
        forced[decision.strip()] = name.strip()
    return forced
