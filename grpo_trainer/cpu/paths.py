"""Which of the CPU layer's fast paths run here, and what a run records of it.

A fast path runs unless `GRPO_TRAINER_CPU_PLAIN` names it (`all`: every one) or one of the torch details it
relies on has changed (torch_internals.py's checks). Then the plain path runs instead, and one warning line
says so, once per process. Each fast path but one gives the plain path's numbers bit for bit (its tests hold it
to that), so its fallback changes speed and memory, not what a run computes; the one that rounds differently,
the onednn_packed decode linear, is an alternative of the decode kernel plan, whose recorded choice a resume
keeps or replaces with a warning that it samples differently. Still, a run records which ran (`record()`: in
decode_kernels.json beside config.yaml and in every checkpoint), and a resume that runs a path differently from
what the run recorded says so (`compare`). The checks run under `fork_rng`: checking never moves a run's
random stream.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from ..errors import ConfigError
from . import torch_internals

logger = logging.getLogger("grpo_trainer")

PLAIN_ENV = "GRPO_TRAINER_CPU_PLAIN"

SAME = "same numbers, slower or more memory"
# name -> (what runs when it is usable, what runs otherwise and what that changes, the torch details it relies on)
FAST_PATHS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "draw": ("the numpy and native multinomial draws (draw.py)", f"torch's own draw ({SAME})", ("generator_state",)),
    "adamw": ("BlockwiseAdamW (adamw.py)", f"torch.optim.AdamW ({SAME})", ("adamw_init_group", "adamw_step")),
    "tied_head": ("the tied output head's own backward (lm_head.py)", f"autograd's ({SAME})", ("module_hook_tables",)),
    "target_logprobs": (
        "the log-prob function's own backward (lm_head.py)",
        f"autograd's ({SAME})",
        ("log_softmax_backward_data",),
    ),
    # An alternative of the decode kernel plan: a run whose plan recorded it says, on resume, that it samples
    # differently here (decode.plan_decode_kernels).
    "onednn_linear": (
        "the onednn_packed decode linear (linear.py)",
        "the decode plan's other linear forms",
        ("mkldnn_linear",),
    ),
}


def plain_paths() -> set[str]:
    """The fast paths `GRPO_TRAINER_CPU_PLAIN="draw,adamw"` (or `all`) turns off; an unknown name is an error."""
    names = {part.strip() for part in os.environ.get(PLAIN_ENV, "").split(",") if part.strip()}
    if "all" in names:
        return set(FAST_PATHS)
    unknown = names - set(FAST_PATHS)
    if unknown:
        raise ConfigError(
            f"{PLAIN_ENV}: {', '.join(sorted(unknown))} is not a CPU fast path; choose from "
            f"{', '.join(FAST_PATHS)} or all"
        )
    return names


@functools.cache
def why_not(name: str) -> str | None:
    """None where fast path `name` runs here; else why not (warned once per process)."""
    what, plain, details = FAST_PATHS[name]
    reason: str | None
    if name in plain_paths():
        reason = f"{PLAIN_ENV} names it"
    else:
        reason = _run_checks(details)
    if reason is not None:
        logger.warning("CPU fast path off: %s does not run, %s instead: %s", what, plain, reason)
    return reason


def _run_checks(details) -> str | None:
    """The first failing check's reason, or None. In a thread of their own: a path is decided where first used,
    which may be inside a no-grad or inference-mode pass or a checkpointed forward, and autograd's modes and a
    checkpoint's saved-tensor hooks are per thread, so none of them reaches the checks (a check that
    differentiated inside a checkpointed chunk changed what that chunk saved, and its recomputation failed).
    Under fork_rng: a check may make a module, and the run's random stream (process-wide) stays put."""
    from concurrent.futures import ThreadPoolExecutor

    def first_failure() -> str | None:
        with torch.random.fork_rng(devices=[]):
            return next(filter(None, (torch_internals.CHECKS[detail]() for detail in details)), None)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-path-checks") as pool:
        return pool.submit(first_failure).result()


def usable(name: str) -> bool:
    return why_not(name) is None


def in_use() -> dict[str, str]:
    """What a run records: "fast" or "plain" per fast path."""
    return {name: "fast" if usable(name) else "plain" for name in FAST_PATHS}


def compare(recorded: dict[str, str] | None) -> list[str]:
    """A resume's lines (also logged as warnings) for each fast path the run recorded that runs differently here."""
    lines = []
    for name, now in in_use().items():
        then = (recorded or {}).get(name)
        if then is not None and then != now:
            lines.append(
                f"CPU fast path {name}: the run ran it {then}, this process runs it {now} "
                f"({why_not(name) or 'its torch details are as expected again'})"
            )
            logger.warning("%s", lines[-1])
    return lines
