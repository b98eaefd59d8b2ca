"""The package's modules import each other without a cycle, counting imports inside functions too.

A cycle that works only because one side imports lazily is still a cycle: the two modules cannot be
understood, tested or moved apart. The graph is read from the source (the AST), not from what an import
happens to execute, so an import inside a function that no test calls is seen as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"


def modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source. `from X import Y` counts as an import
    of the module X.Y when that is a module, else of X. A parent package is not counted as imported by its
    submodules (Python runs its __init__ first, but only the names a module imports make it depend on them)."""
    known = modules(package)
    graph = {}
    for name, (path, is_package) in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in known)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in known:
                        edges.add(target)
                    elif source in known:
                        edges.add(source)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed by an import inside a function, through `from . import`, is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("def build():\n    from .engine import Engine\n")
    (package / "sub" / "engine.py").write_text("from . import build\n")
    (package / "leaf.py").write_text("from .sub import engine\n")
    graph = import_graph(package)
    assert graph["pkg.leaf"] == {"pkg.sub.engine"}
    assert cycles(graph) == [["pkg.sub", "pkg.sub.engine"]]


def test_the_built_ins_reach_the_core_only_through_their_resolver():
    """Outside grpo_trainer.builtin, only the resolver (the package itself) is imported, never its modules."""
    graph = import_graph(PACKAGE)
    reaching_in = {(name, target) for name, targets in graph.items() if not name.startswith("grpo_trainer.builtin")
                   for target in targets if target.startswith("grpo_trainer.builtin.")}
    assert reaching_in == set()
    inside = {target for name, targets in graph.items() if name.startswith("grpo_trainer.builtin") for target in targets}
    leaves = {"grpo_trainer.errors", "grpo_trainer.deepspeed_guard"}  # modules that import nothing from the package
    assert {t for t in inside if not t.startswith("grpo_trainer.builtin")} <= leaves
    assert all(graph[leaf] == set() for leaf in leaves)


def test_rollout_and_environments_meet_only_at_the_engine_protocol():
    """Engines know nothing of environments; environments (tools, the episode loop, every kind) know of the engines
    only their protocol, the `grpo_trainer.rollout` package's own types (RolloutEngine, Rollout, SamplingSettings).
    Imports inside functions and under TYPE_CHECKING count: a lazy import is still a dependency."""
    graph = import_graph(PACKAGE)

    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    rollout, environments = "grpo_trainer.rollout", "grpo_trainer.environments"
    engines_to_environments = {(name, target) for name, targets in graph.items() if inside(name, rollout)
                               for target in targets if inside(target, environments)}
    assert engines_to_environments == set()
    environments_to_engines = {(name, target) for name, targets in graph.items() if inside(name, environments)
                               for target in targets if inside(target, rollout) and target != rollout}
    assert environments_to_engines == set()
    assert any(rollout in graph[name] for name in graph if inside(name, environments))  # the rule is not vacuous
