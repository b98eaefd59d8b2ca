"""rewards.code_tests: both test formats, fractions, binary mode, and hostile completions."""

import json
import os
import sys
import threading

import pytest

from rewards import code_tests
from rewards.code_tests import extract_code, parse_tests

# Runs code as `nobody` in the sandbox: on the same pytest-xdist worker as tests/test_sandbox.py's process census.
pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.slow]  # slow: the code runs in sandboxed processes

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]
HUMANEVAL_TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
DOUBLE_IO = {"inputs": ["2\n", "5\n", "0\n"], "outputs": ["4\n", "10\n", "0\n"]}


def fenced(code):
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds numbers."


def test_correct_snippet_solution_scores_one():
    assert code_tests(None, [fenced("def add(a, b):\n    return a + b")], tests=[ADD_TESTS]) == [1.0]


def test_partial_snippet_solution_scores_the_fraction():
    wrong_for_equal = "def add(a, b):\n    return a + b if a != b else 0"  # fails add(2, 2) only
    assert code_tests(None, [fenced(wrong_for_equal)], tests=[ADD_TESTS]) == [pytest.approx(2 / 3)]


def test_binary_mode_needs_every_test():
    solutions = [fenced("def add(a, b):\n    return a + b"), fenced("def add(a, b):\n    return a * b if a != 0 else b")]
    assert code_tests(None, solutions, tests=[ADD_TESTS, ADD_TESTS], binary=True) == [1.0, 0.0]


def test_humaneval_check_with_entry_point():
    solution = fenced("def add(a, b):\n    return a + b")
    assert code_tests(None, [solution], tests=[[HUMANEVAL_TEST]], entry_point=["add"]) == [1.0]
    wrong = fenced("def add(a, b):\n    return a - b")
    assert code_tests(None, [wrong], tests=[[HUMANEVAL_TEST]], entry_point=["add"]) == [0.0]


def test_humaneval_check_without_a_call_does_not_pass_vacuously():
    solution = fenced("def add(a, b):\n    return a - b")
    assert code_tests(None, [solution], tests=[HUMANEVAL_TEST + "\ncheck(add)\n"]) == [0.0]


def test_stdin_stdout_pairs_as_dict_and_json_string():
    correct = fenced("print(int(input()) * 2)")
    squares = fenced("n = int(input())\nprint(n * n)")  # right for 2 and 0, wrong for 5
    rewards = code_tests(None, [correct, squares, correct], tests=[DOUBLE_IO, DOUBLE_IO, json.dumps(DOUBLE_IO)])
    assert rewards == [1.0, pytest.approx(2 / 3), 1.0]


def test_output_comparison_ignores_surrounding_whitespace_only():
    tests = {"inputs": ["1 2\n"], "outputs": ["1\n2\n"]}
    assert code_tests(None, ["a, b = input().split()\nprint(a + '  ')\nprint(b)\n\n"], tests=[tests]) == [1.0]
    assert code_tests(None, ["a, b = input().split()\nprint(a, b)"], tests=[tests]) == [0.0]


def test_program_exit_status_counts_for_io_tests():
    tests = {"inputs": ["x\n"], "outputs": ["ok\n"]}
    assert code_tests(None, ["import sys\nprint('ok')\nsys.exit(0)"], tests=[tests]) == [1.0]
    assert code_tests(None, ["import sys\nprint('ok')\nsys.exit(3)"], tests=[tests]) == [0.0]


def test_conversational_completion_and_tests_column_kwarg():
    completion = [{"role": "assistant", "content": fenced("def add(a, b):\n    return a + b")}]
    assert code_tests(None, [completion], tests_column="test_list", test_list=[ADD_TESTS], unknown=1) == [1.0]
    with pytest.raises(KeyError, match="test_list"):
        code_tests(None, [completion], tests_column="test_list", tests=[ADD_TESTS])


def test_no_usable_tests_is_no_opinion_and_counted():
    metrics = {}
    rewards = code_tests(
        None, ["x = 1"] * 3,
        tests=[[], None, {"inputs": ["1"], "outputs": ["1"], "fn_name": "f"}],
        log_metric=metrics.__setitem__,
    )
    assert rewards == [None, None, None]
    assert metrics["no_tests"] == 3


def test_extract_code_takes_the_last_fenced_block():
    text = "```python\nfirst = 1\n```\nthen\n```\nsecond = 2\n```"
    assert extract_code(text) == "second = 2\n"
    assert extract_code("plain = 3") == "plain = 3"


def test_parse_tests_formats():
    assert len(parse_tests(ADD_TESTS)) == 3
    assert len(parse_tests(json.dumps(DOUBLE_IO))) == 3
    assert parse_tests(["def check(candidate): pass"], "f")[0].snippet.rstrip().endswith("check(f)")
    assert parse_tests({"inputs": ["1"], "outputs": ["1"], "fn_name": "f"}) is None


# ------------------------------------------------------------- hostile completions


def _hostile(code, tests=ADD_TESTS, timeout=2.0):
    metrics = {}
    rewards = code_tests(None, [fenced(code)], tests=[tests], timeout=timeout, log_metric=metrics.__setitem__)
    assert rewards == [0.0]
    return metrics


def test_infinite_loop_scores_zero_and_counts_timeouts():
    metrics = _hostile("def add(a, b):\n    while True:\n        pass")
    assert metrics["timeouts"] == 3


def test_exit_before_tests_scores_zero():
    _hostile("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)")
    _hostile("import os\nos._exit(0)")


def test_fake_markers_and_patched_assert_score_zero():
    _hostile(
        "import builtins, sys\n"
        "print('PASSED'); print('3/3 tests passed')\n"
        "builtins.AssertionError = SystemExit\n"
        "sys.excepthook = lambda *a: None\n"
        "def add(a, b):\n    return None\n"
    )


def test_tests_run_in_parallel(monkeypatch):
    """Six test runs on six workers are all running at once: each waits at a barrier of six before its sandbox
    starts, so one at a time the first would wait alone until the barrier's timeout breaks it (BrokenBarrierError
    from code_tests). On one worker, one run at a time."""
    add = fenced("def add(a, b):\n    return a + b")
    module = sys.modules[parse_tests.__module__]  # rewards.code_tests (the package's `code_tests` is the function)
    real, lock = module._run_test, threading.Lock()
    running, most, barrier = 0, 0, None

    def counted(*args, **kwargs):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            if barrier is not None:
                barrier.wait()
            return real(*args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(module, "_run_test", counted)
    assert code_tests(None, [add], tests=[ADD_TESTS], max_workers=1) == [1.0]
    assert most == 1
    barrier = threading.Barrier(6, timeout=60)
    assert code_tests(None, [add] * 2, tests=[ADD_TESTS] * 2, max_workers=6) == [1.0, 1.0]
    assert most == 6 and not barrier.broken


def test_secret_environment_is_not_visible_to_code(monkeypatch):
    monkeypatch.setenv("GRPO_REWARD_SECRET", "s3cret-token")
    code = "import os\ndef add(a, b):\n    return a + b\nassert 'GRPO_REWARD_SECRET' not in os.environ"
    assert code_tests(None, [fenced(code)], tests=[ADD_TESTS]) == [1.0]
    assert os.environ["GRPO_REWARD_SECRET"] == "s3cret-token"
