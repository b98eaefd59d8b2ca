"""`save_pretrained` without importing DeepSpeed, for every save in a process that does not use it.

transformers' `save_pretrained` unwraps the model with Accelerate's `extract_model_from_parallel`, which
imports DeepSpeed wherever it is installed, only to recognise its engine: seconds of every save (docs/performance.md,
"The demo, the install and the test suite"), and DeepSpeed's banner ("Setting accelerator to CPU ...") in a run on a machine without GPUs. A
model cannot be a DeepSpeed engine while DeepSpeed has never been imported, so Accelerate is told for the
duration of the save that it is absent. A leaf module (it imports nothing from the package), so that the
built-in models' builder (grpo_trainer/builtin) uses it too; distributed.unwrap does the same for unwrapping.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def deepspeed_left_unimported():
    """Around a `save_pretrained`: Accelerate sees DeepSpeed as absent unless something already imported it."""
    import accelerate.utils.other as accelerate_other

    if "deepspeed" in sys.modules or not hasattr(accelerate_other, "is_deepspeed_available"):
        yield
        return
    available = accelerate_other.is_deepspeed_available
    accelerate_other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        accelerate_other.is_deepspeed_available = available
