"""Only the loop and the builder take the whole `Run`: every other function is given the parts it reads.

Read from the source (the AST), so a function no test calls is checked as well: a parameter annotated `Run`
(or `run.Run`), or named `run` without an annotation that says it is something else (plot.py's `RunMetrics`),
is allowed only in the functions listed here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"

# (module file, function): the loop in trainer.py, and run.py's builder with the run's lifecycle around it.
TAKES_THE_RUN = {
    ("trainer.py", "train_step"),
    ("trainer.py", "step_advantages"),
    ("trainer.py", "periodic_eval"),
    ("trainer.py", "report"),
    ("trainer.py", "preempt"),
    ("run.py", "resume"),
    ("run.py", "finish"),
    ("run.py", "stop_run"),
    ("run.py", "_save_final_model"),
}


def names_the_run(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(
        (isinstance(node, ast.Name) and node.id == "Run") or (isinstance(node, ast.Attribute) and node.attr == "Run")
        for node in ast.walk(annotation)
    )


def takes_the_run(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    return any(
        names_the_run(arg.annotation) or (arg.arg == "run" and arg.annotation is None)
        for arg in every
        if arg is not None
    )


def functions_taking_the_run(package: Path) -> set[tuple[str, str]]:
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and takes_the_run(node):
                found.add((path.relative_to(package).as_posix(), node.name))
    return found


def test_only_the_loop_and_the_builder_take_the_run():
    found = functions_taking_the_run(PACKAGE)
    assert found - TAKES_THE_RUN == set(), "give these the parts of the run they read, not the run"
    assert TAKES_THE_RUN - found == set(), "no longer take the run: drop them from TAKES_THE_RUN"


def test_the_check_sees_each_way_of_taking_the_run(tmp_path):
    (tmp_path / "phases.py").write_text(
        "from .state import Run\nfrom . import state\n\n"
        "def plain(run): ...\n"
        "def annotated(r: Run): ...\n"
        "def dotted(*, r: 'state.Run'): ...\n"
        "def optional(r: Run | None = None): ...\n"
        "class Phase:\n    def method(self, run): ...\n"
        "def metrics(run: RunMetrics): ...\n"  # a run of another kind
        "def narrow(policy, batch, settings): ...\n"
    )
    assert functions_taking_the_run(tmp_path) == {
        ("phases.py", name) for name in ("plain", "annotated", "dotted", "optional", "method")
    }
