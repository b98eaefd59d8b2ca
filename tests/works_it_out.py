"""A reward for the tiny model's one learnable habit, used by tests/test_loss_family_2026.py's learning demos.

The tiny model's warm start writes the sum out before its boxed answer ("7+5=\\boxed{12}") about a quarter of the
time and blurts a guess ("\\boxed{9}") otherwise (grpo_trainer/builtin/tiny.py). Whether it works the sum out is one
decision at the first token, the same for every prompt, so any loss that optimises its objective raises this
reward within a few steps, on any build of the model (how often the worked-out sum is also right depends on
how well the build learnt to read the prompt; `math_accuracy` measures that).
"""

from __future__ import annotations

import re

WORKED = re.compile(r"^\s*\d+\s*\+\s*\d+\s*=\s*\\boxed\{")


def works_it_out(prompts, completions, **kwargs) -> list[float]:
    return [1.0 if WORKED.match(c) else 0.0 for c in completions]
