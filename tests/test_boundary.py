"""Training reads the records collect ends in (samples.py), never what produced them.

Producing samples (engines, environments, tools, rewards) works with the engine's `Rollout` and live environment
objects; collect turns them into `TrainingSamples`, `EpisodeStats` and the step's metrics. Read from the source
(the AST), so that code no test runs is checked too: the modules after collect import nothing of `rollout/` or
`environments/`, never name `Rollout`, read no `.rollout` but the config's section, and their phases take the
boundary's records by type.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import PACKAGE, import_graph

# The training side: the loop's step after collect, and every phase and formula it calls.
TRAINING_SIDE = ("trainer.py", "batches.py", "update.py", "report.py", "advantages.py", "losses.py", "train_state.py",
                 "samples.py", "terms/*.py")
PRODUCING = ("grpo_trainer.rollout", "grpo_trainer.environments", "grpo_trainer.agents")

# (module, function, parameter) -> the record it is annotated with: the phases after collect take these.
TAKES_THE_RECORDS = {
    ("batches.py", "build_train_batch", "samples"): "TrainingSamples",
    ("update.py", "check_scored", "episodes"): "EpisodeStats",
    ("report.py", "step_record", "scored"): "ScoredBatch",
    ("report.py", "completion_samples", "samples"): "TrainingSamples",
    ("report.py", "completion_samples", "episodes"): "EpisodeStats",
    ("trainer.py", "step_advantages", "samples"): "TrainingSamples",
    ("trainer.py", "report", "scored"): "ScoredBatch",
}


def training_files(package: Path) -> list[Path]:
    return sorted(path for pattern in TRAINING_SIDE for path in package.glob(pattern))


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def producing_imports(package: Path) -> set[tuple[str, str]]:
    graph = import_graph(package)
    names = {module_name(path, package) for path in training_files(package)}
    return {(name, target) for name in names for target in graph.get(name, ())
            if any(target == p or target.startswith(p + ".") for p in PRODUCING)}


def off_a_config(node: ast.expr) -> bool:
    """`cfg.rollout`, `run.cfg.rollout`, `self.cfg.rollout`: the config's section, not an engine's result."""
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def quoted_annotations(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """The annotations written as strings, parsed (line, expression)."""
    found = []
    for node in ast.walk(tree):
        written: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            written.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            written.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            written.append(node.annotation)
        for annotation in written:
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                found.append((annotation.lineno, ast.parse(annotation.value, mode="eval").body))
    return found


def reads_of_the_rollout(path: Path) -> list[str]:
    """Where a module imports or names `Rollout` (in code or a quoted annotation), or reads a `.rollout` that is not
    the config's section."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for line, quoted in quoted_annotations(tree):
        if any(isinstance(n, ast.Name) and n.id == "Rollout" for n in ast.walk(quoted)):
            found.append((line, "'Rollout'"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "Rollout" for alias in node.names):
            found.append((node.lineno, "import Rollout"))
        elif isinstance(node, ast.Name) and node.id == "Rollout":
            found.append((node.lineno, "Rollout"))
        elif isinstance(node, ast.Attribute) and node.attr == "Rollout":
            found.append((node.lineno, ".Rollout"))
        elif isinstance(node, ast.Attribute) and node.attr == "rollout" and not off_a_config(node.value):
            found.append((node.lineno, ".rollout"))
    return [f"{path.name}:{line} {what}" for line, what in sorted(found)]


def annotations(package: Path) -> dict[tuple[str, str, str], str]:
    """(module, function, parameter) -> its annotation as written, for the functions of the training side."""
    found = {}
    for path in training_files(package):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                    if arg.annotation is not None:
                        found[(path.relative_to(package).as_posix(), node.name, arg.arg)] = ast.unparse(arg.annotation)
    return found


def test_the_training_side_imports_nothing_that_produces_samples():
    assert producing_imports(PACKAGE) == set(), "training reads samples.py's records, not engines or environments"


def test_the_training_side_reads_no_rollout():
    found = [where for path in training_files(PACKAGE) for where in reads_of_the_rollout(path)]
    assert found == [], "read the step's TrainingSamples / EpisodeStats (samples.py), not the engine's Rollout"


def test_the_phases_after_collect_take_the_boundary_records():
    written = annotations(PACKAGE)
    assert {key: written.get(key) for key in TAKES_THE_RECORDS} == TAKES_THE_RECORDS


def test_the_records_are_plain_data():
    """samples.py imports nothing of the package: its records carry no engine, environment or run."""
    graph = import_graph(PACKAGE)
    assert graph["grpo_trainer.samples"] == set()


def test_the_checks_see_each_way_back_to_the_rollout(tmp_path):
    package = tmp_path / "grpo_trainer"
    (package / "rollout").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rollout" / "__init__.py").write_text("class Rollout: ...\n")
    (package / "report.py").write_text(
        "from .rollout import Rollout\n\n"
        "def f(scored): return scored.rollout.truncated\n"  # 3: a .rollout read
        "def g(x: 'Rollout'): ...\n"  # 4: a quoted annotation
        "def h(cfg, run): return cfg.rollout.temperature, run.cfg.rollout.top_p\n"  # 5: the config's section: fine
        "def lazy():\n    from grpo_trainer import rollout\n    return rollout.Rollout\n"  # 6-8
    )
    assert producing_imports(package) == {("grpo_trainer.report", "grpo_trainer.rollout")}
    assert reads_of_the_rollout(package / "report.py") == [
        "report.py:1 import Rollout", "report.py:3 .rollout", "report.py:4 'Rollout'", "report.py:8 .Rollout"]
