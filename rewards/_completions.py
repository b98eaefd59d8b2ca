"""Helpers every reward needs: turn a TRL completion into text, report metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MetricLogger = Callable[[str, float], None] | None


def completion_text(completion: Any) -> str:
    """The generated text of one completion.

    TRL passes plain strings for standard datasets and message lists
    (``[{"role": "assistant", "content": ...}]``) for conversational ones; for
    the latter the reply is the content of the last assistant message (in a
    multi-turn completion, never a tool's output: a program the model ran must
    not be able to print the answer that is graded).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion:
        replies = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        last = replies[-1] if replies else completion[-1]
        if isinstance(last, dict):
            content = last.get("content", "")
            if isinstance(content, list):  # multimodal-style parts: keep the text parts
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return "" if content is None else str(content)
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return "" if completion is None else str(completion)


def report(log_metric: MetricLogger, name: str, value: float) -> None:
    """Send one metric to the trainer if it gave us a logger (it may not)."""
    if log_metric is not None:
        log_metric(name, float(value))


def shorten(text: str, limit: int = 80) -> str:
    """A one-line preview of possibly huge text, for log messages."""
    flat = text.replace("\n", "\\n")
    if len(flat) <= limit:
        return flat
    return f"{flat[:limit]}... ({len(text)} chars)"
