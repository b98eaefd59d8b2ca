"""rewards.think_format and rewards.overlong_penalty (DAPO eq. 13)."""

import pytest

from rewards import overlong_penalty, think_format
from rewards.format import soft_overlong_punishment


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>\nadd them\n</think>\nThe answer is 4.", 1.0),
        ("  <think>short</think>4", 1.0),
        ("<think>a</think>\n\n\\boxed{4}\n", 1.0),
        ("The answer is 4.", 0.0),  # no tags
        ("<think>thinking without end", 0.0),
        ("<think>reasoning</think>", 0.0),  # no answer
        ("<think>reasoning</think>   \n", 0.0),  # whitespace is not an answer
        ("<think>   </think>4", 0.0),  # empty thought
        ("4 <think>late</think> 4", 0.0),  # must start with the thought
        ("<think>a</think>4<think>b</think>5", 0.0),  # second block
        ("<think>a</think>4</think>", 0.0),  # stray closing tag
        ("<think><think>a</think>4", 0.0),  # nested opening tag
    ],
)
def test_think_format(completion, expected):
    assert think_format(None, [completion]) == [expected]


def test_think_format_conversational_and_opened_in_prompt():
    message = [{"role": "assistant", "content": "<think>x</think>y"}]
    assert think_format(None, [message], unknown_kwarg=1) == [1.0]
    assert think_format(None, ["reasoning</think>answer"], think_opened_in_prompt=True) == [1.0]
    assert think_format(None, ["<think>reasoning</think>answer"], think_opened_in_prompt=True) == [0.0]


def test_soft_overlong_punishment_matches_dapo_eq_13():
    # L_max = 100, L_cache = 20: free up to 80 tokens, linear to -1 at 100, -1 beyond.
    assert soft_overlong_punishment(50, 100, 20) == 0.0
    assert soft_overlong_punishment(80, 100, 20) == 0.0
    assert soft_overlong_punishment(81, 100, 20) == pytest.approx(-1 / 20)
    assert soft_overlong_punishment(90, 100, 20) == pytest.approx(-0.5)
    assert soft_overlong_punishment(100, 100, 20) == pytest.approx(-1.0)
    assert soft_overlong_punishment(101, 100, 20) == -1.0


def test_overlong_penalty_counts_tokens_not_characters():
    ids = [[1] * 10, [1] * 15, [1] * 25]
    rewards = overlong_penalty(None, ["x" * 1000] * 3, completion_ids=ids, max_length=20, buffer=10, other=1)
    assert rewards == [0.0, pytest.approx(-0.5), -1.0]


def test_overlong_penalty_requires_its_inputs():
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(None, ["x"], completion_ids=[[1]])
    with pytest.raises(ValueError, match="completion_ids"):
        overlong_penalty(None, ["x"], max_length=10, buffer=2)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(None, ["x"], completion_ids=[[1]], max_length=10, buffer=20)
