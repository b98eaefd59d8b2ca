"""Shaping rewards: the reasoning-tag format and DAPO's soft overlong punishment."""

from __future__ import annotations

import re
from typing import Any

from ._completions import completion_text

# Leading whitespace, "<think>", a thought with some non-space text, "</think>",
# then an answer with some non-space text. Neither tag may appear again.
_THINK_THEN_ANSWER = re.compile(r"\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)", re.DOTALL)


def think_format(
    prompts: Any,
    completions: list,
    completion_ids: Any = None,
    *,
    think_opened_in_prompt: bool = False,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if the completion is ``<think>THOUGHT</think>ANSWER``, else 0.0.

    Precisely: after optional leading whitespace the completion starts with
    ``<think>``; exactly one ``<think>`` and exactly one ``</think>`` occur, in
    that order; both THOUGHT and ANSWER contain a non-whitespace character.
    Whitespace and newlines around the tags are free.

    Args:
        think_opened_in_prompt: set for chat templates that already end the
            prompt with ``<think>`` (e.g. DeepSeek-R1, Qwen3 thinking): the
            completion then starts with the thought and contains no ``<think>``.
    """
    rewards: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        if think_opened_in_prompt:
            text = "<think>" + text
        match = _THINK_THEN_ANSWER.fullmatch(text)
        ok = (
            match is not None
            and text.count("<think>") == 1
            and text.count("</think>") == 1
            and match["thought"].strip() != ""
            and match["answer"].strip() != ""
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def soft_overlong_punishment(length: int, max_length: int, buffer: int) -> float:
    """DAPO's length reward (Yu et al. 2025, "DAPO", eq. 13).

    With L_max = ``max_length`` and L_cache = ``buffer``:
      0                                   if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
      -1                                  if |y| > L_max
    """
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / buffer
    return -1.0


def overlong_penalty(
    prompts: Any,
    completions: list,
    completion_ids: Any = None,
    *,
    max_length: int | None = None,
    buffer: int | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """DAPO soft overlong punishment of each completion's length in tokens, in [-1, 0].

    Args:
        max_length: L_max in tokens. DAPO uses the generation limit here
            (20480 with a 4096 buffer); with ``max_length`` equal to the
            trainer's ``max_completion_length`` the -1 branch never fires.
        buffer: L_cache in tokens, the ramp before ``max_length``.

    Lengths come from ``completion_ids`` (token ids per completion, as the
    trainer passes them), never from characters.
    """
    if max_length is None or buffer is None:
        raise ValueError("overlong_penalty needs kwargs max_length and buffer (tokens), e.g. 4096 and 512")
    if not 0 < buffer <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}"
        )
    if completion_ids is None:
        raise ValueError("overlong_penalty measures tokens and needs completion_ids from the trainer")
    return [soft_overlong_punishment(len(ids), max_length, buffer) for ids in completion_ids]
