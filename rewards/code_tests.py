"""``code_tests``: the fraction of a sample's tests that the completion's code passes.

The code is the last fenced block of the completion (```python ... ``` or a
bare ``` fence), or the whole text if it has none. Tests come from the dataset
column ``tests_column`` in one of two formats:

* a list of Python snippets (or one snippet) run after the code in the same
  module: MBPP's ``assert f(1) == 2`` lines, or HumanEval's
  ``def check(candidate): ...``. If a snippet defines ``check`` without calling
  it and the sample has an ``entry_point`` column, ``check(<entry_point>)`` is
  appended. A snippet passes if the code and the snippet run to completion
  (the sandbox's nonce verdict: exiting early does not count).
* stdin/stdout pairs, ``{"inputs": [...], "outputs": [...]}`` (APPS,
  LiveCodeBench), as a dict or a JSON string. A pair passes if the program
  exits with status 0 and its stdout equals the expected output line by line,
  ignoring surrounding whitespace on each line and blank lines at the ends.
  Call-based APPS samples (with ``fn_name``) are not supported: reward None.

Every test is one sandboxed process (``rewards/sandbox.py``), so a crash or
hang in one test does not hide the others. Tests run in parallel, up to
``max_workers`` at a time. Samples without usable tests get None (no opinion),
counted as ``no_tests``; ``timeouts`` counts tests killed at the time limit.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import sandbox
from ._completions import MetricLogger, completion_text, report

logger = logging.getLogger(__name__)

_FENCED_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_CALLS_CHECK = re.compile(r"^check\s*\(", re.MULTILINE)


@dataclass(frozen=True)
class _Test:
    snippet: str = ""  # Python run after the code (snippet format)
    stdin: str | None = None  # stdin/stdout format: the input ...
    expected: str | None = None  # ... and the expected output


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole text if there is none."""
    blocks = _FENCED_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_tests(tests: Any, entry_point: str | None = None) -> list[_Test] | None:
    """The sample's tests in either format, or None if there are none we can run."""
    if isinstance(tests, str) and tests.lstrip()[:1] in ("{", "["):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            pass  # a snippet that happens to start with a bracket
    if isinstance(tests, dict):
        if tests.get("fn_name") or "inputs" not in tests or "outputs" not in tests:
            return None
        pairs = list(zip(tests["inputs"], tests["outputs"]))
        return [_Test(stdin=_as_text(i), expected=_as_text(o)) for i, o in pairs] or None
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)):
        return None
    snippets = [t for t in tests if isinstance(t, str) and t.strip()]
    if entry_point:
        snippets = [
            s + f"\n\ncheck({entry_point})\n" if "def check(" in s and not _CALLS_CHECK.search(s) else s
            for s in snippets
        ]
    return [_Test(snippet=s) for s in snippets] or None


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.strip() for line in text.strip().splitlines()]

    return lines(actual) == lines(expected)


def _run_test(code: str, test: _Test, limits: sandbox.Limits) -> sandbox.RunResult:
    if test.stdin is None or test.expected is None:  # a snippet test (a stdin/stdout test has both)
        return sandbox.run_python(code, test.snippet, limits=limits)
    return sandbox.run_python(code, stdin=test.stdin.encode(), limits=limits)


def _passed(test: _Test, result: sandbox.RunResult) -> bool:
    if test.expected is None:
        return result.completed
    # Exiting early with sys.exit(0) is fine for a program judged by its output.
    ok_exit = result.returncode == 0 and not result.timed_out and not result.output_overflow
    return ok_exit and _same_output(result.stdout.decode("utf-8", "replace"), test.expected)


def code_tests(
    prompts: Any,
    completions: list,
    completion_ids: Any = None,
    *,
    tests_column: str = "tests",
    timeout: float = 10.0,
    binary: bool = False,
    max_workers: int | None = None,
    memory_limit_mb: int = 1024,
    log_metric: MetricLogger = None,
    **kwargs: Any,
) -> list[float | None]:
    """Fraction of tests passed per completion (1.0/0.0 with ``binary=True``).

    Args:
        tests_column: dataset column with each sample's tests.
        timeout: wall-clock seconds per test run (CPU time is limited to about the same).
        binary: reward 1.0 only if every test passes.
        max_workers: test processes run at once (default: number of CPUs).
        memory_limit_mb: address-space limit of each test process.
        log_metric: ``callable(name, value)`` for ``timeouts``, ``no_tests`` and ``runs``.
    """
    if tests_column not in kwargs:
        raise KeyError(
            f"code_tests needs the dataset column {tests_column!r}; "
            f"got columns {sorted(k for k in kwargs if k != 'log_metric')} (set the reward kwarg tests_column)"
        )
    entry_points = kwargs.get("entry_point") or [None] * len(completions)
    limits = sandbox.Limits(wall_seconds=float(timeout), memory_bytes=memory_limit_mb * 2**20)

    jobs: list[tuple[int, str, _Test]] = []
    per_sample: list[list[_Test] | None] = []
    for i, (completion, tests, entry_point) in enumerate(zip(completions, kwargs[tests_column], entry_points)):
        parsed = parse_tests(tests, entry_point)
        per_sample.append(parsed)
        code = extract_code(completion_text(completion))
        jobs += [(i, code, test) for test in parsed or []]

    with ThreadPoolExecutor(max_workers=max_workers or os.cpu_count() or 1) as executor:
        results = list(executor.map(lambda job: _run_test(job[1], job[2], limits), jobs))

    passed = [0] * len(completions)
    for (i, _, test), result in zip(jobs, results):
        passed[i] += _passed(test, result)

    rewards: list[float | None] = []
    for i, tests in enumerate(per_sample):
        if tests is None:
            rewards.append(None)
        elif binary:
            rewards.append(1.0 if passed[i] == len(tests) else 0.0)
        else:
            rewards.append(passed[i] / len(tests))

    report(log_metric, "timeouts", sum(r.timed_out for r in results))
    report(log_metric, "no_tests", sum(t is None for t in per_sample))
    report(log_metric, "runs", len(results))
    return rewards
