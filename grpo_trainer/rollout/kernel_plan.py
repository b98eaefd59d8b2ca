"""The hf engine's kernel plan: which of its decode loop's alternative kernels it samples with, for every shape it
will reach, fixed before it samples anything (kernels.py says how each choice is made, and why never by a timing
where the alternatives round differently).

The engine is built knowing its reach (`DecodeReach`: the most rows one decode step holds, the longest context),
whether this process decides the plan (the main process: it reads and fills this machine's kernel cache) and how
the ranks agree on it (`share`: the main process's plan handed to every rank, so all sample alike). The run hands
it a resumed run's recorded plan (`settle`, through `PlansKernels.settle_kernels`) and records the plan it gets
back. An engine built without a reach (an evaluation of its own, the token endpoint's) plans for the shapes of
its first call, or is given a plan, and can widen it (`HFEngine.widen_kernels`) to more rows or a longer context,
keeping every choice it holds.

Deliberately not here: the choices themselves (decode.plan_decode_kernels, the rule in kernels.py) and what a
run reaches (run.py counts its batches, its eval batches and its prompts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import TrainingError


@dataclass(frozen=True)
class DecodeReach:
    """The most rows one decode step holds (prompts per generate call x completions each) and the longest context
    (prompt + completion) an engine's sampling reaches: what its plan must cover."""

    rows: int
    context: int


@dataclass(frozen=True)
class KernelPlanning:
    """How an engine that samples for a run plans its kernels: for `reach`; decided where `decides` (the main
    process), every rank then taking that plan through `share` (an all-gather's first item; None: one process)."""

    reach: DecodeReach
    decides: bool = True
    share: Callable[[Any], Any] | None = None


def settle(planning: KernelPlanning, plan_here: Callable[[bool], dict[str, str]]) -> dict[str, str]:
    """The plan every rank samples with: `plan_here(decides)` on each rank (it takes part in any collective the
    planning needs, and plans only where it decides), the deciding process's result then handed to all. Whatever
    planning raises there is carried to every rank, so all stop with its line instead of waiting for a plan."""
    try:
        plan, error = plan_here(planning.decides), None
    except Exception as exc:
        if planning.share is None:
            raise
        plan, error = {}, f"decode kernels: {exc}"
    if planning.share is not None:
        plan, error = planning.share((plan, error))
    if error is not None:
        raise TrainingError(error)
    return plan
