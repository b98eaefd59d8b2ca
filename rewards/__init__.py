"""Built-in verifiable rewards with TRL's signature.

Each is ``fn(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]``;
dataset columns and the reward's YAML kwargs arrive as keyword arguments, and
``None`` means "no opinion". Importing this package is cheap (standard library
only): worker processes start on first use. See docs/rewards.md.
"""

from .code_tests import code_tests
from .format import overlong_penalty, think_format
from .math_answer import math_accuracy

__all__ = ["math_accuracy", "code_tests", "think_format", "overlong_penalty"]
