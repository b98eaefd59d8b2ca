"""rewards.math_accuracy: answer equivalences, near misses, hostile inputs, hard timeouts."""

import logging
import threading

import pytest

from rewards import math_accuracy
from rewards.math_answer import _fast_verdict, last_boxed, plain_number, shutdown_workers

TIMEOUT = 2.0  # per-sample seconds for the hostile cases; a worker restart costs ~1 s more

# (gold, completion): the completion's final answer equals the gold.
EQUIVALENT = [
    ("8", "So the total is \\boxed{8}."),
    ("8", "The answer is 8"),
    ("8", "8"),
    ("-3", "\\boxed{-3}"),
    ("8", "\\boxed{8.0}"),
    ("2.50", "\\boxed{2.5}"),
    ("1000", "\\boxed{1,000}"),
    ("1,000", "\\boxed{1000}"),
    ("1000000", "\\boxed{1{,}000{,}000}"),
    ("12000", "\\boxed{12\\,000}"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("1/2", "\\boxed{\\frac12}"),
    ("\\frac{3}{4}", "\\boxed{3/4}"),
    ("\\dfrac{3}{4}", "\\boxed{\\tfrac{3}{4}}"),
    ("0.75", "\\boxed{\\frac{6}{8}}"),
    ("\\frac{1}{3}", "\\boxed{\\frac{2}{6}}"),
    ("\\frac{1}{3}", "\\boxed{0.333333}"),
    ("$\\frac{1}{2}$", "The probability is $\\frac{1}{2}$."),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}"),
    ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}"),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("2\\pi", "\\boxed{2 \\pi}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}"),
    ("e^{2}", "\\boxed{e^2}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("2x+3", "\\boxed{3+2x}"),
    ("x=5", "\\boxed{5}"),
    ("5", "\\boxed{x = 5}"),
    ("y = 2x + 1", "\\boxed{y=1+2x}"),
    ("0.5", "\\boxed{50\\%}"),
    ("50\\%", "\\boxed{50}"),
    ("25\\%", "\\boxed{25\\%}"),
    ("(1,2]", "\\boxed{(1,2]}"),
    ("[0,\\infty)", "\\boxed{[0, \\infty)}"),
    ("(-\\infty, 3)", "\\boxed{(-\\infty,3)}"),
    ("\\{1,2,3\\}", "\\boxed{\\{3,2,1\\}}"),
    ("1,2", "\\boxed{2, 1}"),
    ("\\infty", "\\boxed{\\infty}"),
    ("5\\text{ cm}", "\\boxed{5}"),
    ("5", "\\boxed{5\\text{ cm}}"),
    ("12", "\\boxed{12 \\text{ apples}}"),
    ("90^\\circ", "\\boxed{90}"),
    ("\\$18", "\\boxed{18}"),
    ("18", "\\boxed{\\$18}"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}"),
    ("3+4i", "\\boxed{4i+3}"),
    ("\\frac{1}{2}", "First I thought \\boxed{3}, but rechecking, \\boxed{\\frac{1}{2}}."),
    ("42", "After a long derivation... Final answer: $\\boxed{42}$"),
    ("7", "\\fbox{7}"),
    ("10", "\\boxed 10"),
    ("\\frac{1}{4}", "The answer is $\\frac{1}{4}$"),
    ("1.5", "\\boxed{\\frac{3}{2}}"),
    ("-\\frac{1}{2}", "\\boxed{-0.5}"),
]

# (gold, completion): close, but not the gold answer.
NEAR_MISS = [
    ("8", "\\boxed{9}"),
    ("8", "\\boxed{-8}"),
    ("8", "\\boxed{80}"),
    ("1000", "\\boxed{100}"),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("\\frac{1}{3}", "\\boxed{0.33}"),
    ("2.5", "\\boxed{2.4}"),
    ("\\sqrt{2}", "\\boxed{2}"),
    ("x^2+2x+1", "\\boxed{x^2+1}"),
    ("(1,2]", "\\boxed{[1,2]}"),
    ("(1,2)", "\\boxed{(1,3)}"),
    ("\\{1,2,3\\}", "\\boxed{\\{1,2\\}}"),
    ("\\pi", "\\boxed{3}"),
    ("2x+3", "\\boxed{2y+3}"),
    ("8", "\\boxed{8} is wrong, the answer is \\boxed{7}"),
    ("8", "no answer here"),
    ("8", ""),
    ("3+4i", "\\boxed{3-4i}"),
]


def _reward(gold, completion, **kwargs):
    return math_accuracy(["prompt"], [completion], answer=[gold], **kwargs)[0]


def test_pair_table_is_big_enough():
    assert len(EQUIVALENT) + len(NEAR_MISS) >= 60


def test_equivalent_answers_match():
    rewards = math_accuracy(None, [c for _, c in EQUIVALENT], answer=[g for g, _ in EQUIVALENT])
    wrong = [pair for pair, r in zip(EQUIVALENT, rewards) if r != 1.0]
    assert wrong == []


def test_near_misses_do_not_match():
    rewards = math_accuracy(None, [c for _, c in NEAR_MISS], answer=[g for g, _ in NEAR_MISS])
    wrong = [pair for pair, r in zip(NEAR_MISS, rewards) if r != 0.0]
    assert wrong == []


def test_fast_path_agrees_with_math_verify():
    """Every pair the fast path decides, math-verify decides the same way."""
    decided = [(g, c) for g, c in EQUIVALENT + NEAR_MISS if _fast_verdict(g, last_boxed(c) or c) is not None]
    assert len(decided) >= 8
    metrics = {}
    slow = math_accuracy(
        None,
        [f"The result is \\boxed{{{last_boxed(c) or c}}} \\text{{ units}}" for _, c in decided],  # defeats the fast path
        answer=[f"{g}\\text{{ units}}" for g, _ in decided],
        log_metric=metrics.__setitem__,
    )
    assert metrics["fast_path"] == 0
    fast = [1.0 if _fast_verdict(g, last_boxed(c) or c) == "match" else 0.0 for g, c in decided]
    assert slow == fast


def test_plain_integers_skip_the_workers():
    metrics = {}
    rewards = math_accuracy(None, ["\\boxed{8}", "8", "\\boxed{9}"], answer=["8", "8", "8"], log_metric=metrics.__setitem__)
    assert rewards == [1.0, 1.0, 0.0]
    assert metrics["fast_path"] == 3


def test_plain_number_parser():
    assert plain_number("1,234.5") == plain_number("1234.50")
    assert plain_number("$-7$") == -7
    assert plain_number("1,23") is None  # not a thousands grouping
    assert plain_number("3/4") is None


def test_last_boxed_handles_nesting_and_truncation():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{\\frac{1}{2") is None
    assert last_boxed("no box") is None


def test_conversational_completions():
    completion = [{"role": "assistant", "content": "\\boxed{\\frac{1}{2}}"}]
    assert math_accuracy(None, [completion], answer=["0.5"]) == [1.0]


def test_answer_column_kwarg_and_unknown_kwargs():
    rewards = math_accuracy(None, ["\\boxed{4}"], answer_column="solution", solution=["4"], answer=["5"], some_other=1)
    assert rewards == [1.0]
    with pytest.raises(KeyError, match="solution"):
        math_accuracy(None, ["\\boxed{4}"], answer_column="solution", answer=["4"])


def test_unparseable_gold_is_no_opinion_and_counted():
    metrics = {}
    rewards = math_accuracy(None, ["\\boxed{4}", "\\boxed{4}", "\\boxed{4}"], answer=["???", "", "4"], log_metric=metrics.__setitem__)
    assert rewards == [None, None, 1.0]
    assert metrics["gold_unparseable"] == 2


def test_missing_log_metric_is_fine():
    assert math_accuracy(None, ["\\boxed{4}"], answer=["???"]) == [None]


HOSTILE = {
    "tower_of_powers": "\\boxed{10^{10^{10}}}",
    "huge_factorial": "\\boxed{(10^{7})!}",
    "huge_expansion": "\\boxed{(x+1)^{100000}}",
    "nested_fractions": "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "megabyte_of_text": "lorem ipsum " * 90_000,
    "megabyte_box": "\\boxed{" + "9+" * 500_000 + "9}",
    "unicode_junk": "\\boxed{\u202e\u0000\ufffd\U0001f600∫∑√∞≠ \udcff}" + "\u200b" * 1000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.slow
def test_hostile_completion_returns_within_timeout(name):
    """Each returns 0: stopped at the timeout (the worker killed and counted), or refused without one. Two of
    them cannot be parsed in the time on any machine: those must have been stopped (an event, not a clock)."""
    metrics = {}
    assert math_accuracy(["prompt"], [HOSTILE[name]], answer=["2"], timeout=TIMEOUT, log_metric=metrics.__setitem__) == [0.0]
    if name in ("tower_of_powers", "huge_expansion"):
        assert metrics["timeouts"] == 1


@pytest.mark.slow
def test_timeout_is_enforced_from_a_non_main_thread():
    """math-verify's own timeout uses signal.alarm, which fails outside the main thread."""
    results, metrics = {}, {}

    def run():
        results["rewards"] = math_accuracy(
            None, [HOSTILE["huge_expansion"], "\\boxed{\\frac{1}{2}}"], answer=["2", "0.5"],
            timeout=TIMEOUT, log_metric=metrics.__setitem__,
        )

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=300)  # a guard against hanging the suite, far above any duration: not a speed claim
    assert not thread.is_alive()
    assert results["rewards"] == [0.0, 1.0]
    assert metrics["timeouts"] == 1  # stopped by the timeout (the worker killed), from a non-main thread


@pytest.mark.slow
def test_pool_recovers_after_timeout():
    assert _reward("2", HOSTILE["huge_factorial"], timeout=TIMEOUT) == 0.0
    assert _reward("\\frac{2}{3}", "\\boxed{4/6}") == 1.0


@pytest.mark.slow
def test_timeout_warning_is_short(caplog):
    caplog.set_level(logging.DEBUG)
    huge = "\\boxed{(x+1)^{100000}}" + " pad" * 250_000  # 1 MB that ends in a slow answer
    assert _reward("2", huge, timeout=TIMEOUT) == 0.0
    assert "exceeded" in caplog.text
    assert len(caplog.text) < 1000


@pytest.mark.slow
def test_shutdown_then_reuse():
    shutdown_workers()
    assert _reward("\\frac{2}{3}", "\\boxed{4/6}") == 1.0
