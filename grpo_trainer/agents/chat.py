"""Chat requests to token ids, token-faithfully: the sampled ids of earlier turns are reused, never re-tokenized.

An agent that speaks chat sends its whole conversation each turn, the policy's earlier replies as text. Rendering
that text again with the chat template need not give back the tokens that were sampled (a reply tokenized another
way, a template that renders earlier turns differently, e.g. without their `<think>`). So (docs/agents.md):

1. The request's messages are rendered with the policy's chat template (`F`, with the generation prompt).
2. The episode's chat turns are searched, newest first, for one whose messages M and reply A (the text the endpoint
   answered) the request's messages start with: M, then an assistant message with content A.
3. For that turn, with `base` = render(M) (with the generation prompt) and `full` = render(M + [A]): if `full`
   starts with `base`, `F` starts with `full`, and the reply's tokens in `full` start with the sampled completion
   (its final stop token aside), the prompt is the turn's own prompt + completion, then what the template adds
   after the reply (its end-of-turn tokens), then the rest of `F`. The turn is continued, token for token.
4. Otherwise, if such a turn was found, the rendering diverges from what was sampled: the request is served on `F`,
   counted as re-rendered (`agent/rerendered_turns`), and starts a new branch (records.py; every branch is trained,
   producer.py). No turn found: a new conversation, served on `F`, a new branch, not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .records import EpisodeRequests, TurnRecord


class BadMessages(ValueError):
    """The request's messages cannot be rendered (the message says why)."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts with string content (text parts joined); refused when malformed."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadMessages(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # OpenAI content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise BadMessages(f"messages[{i}].content: only text parts are served")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise BadMessages(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**message, "content": content})
    return out


def _key(message: dict[str, Any]) -> tuple[str, str]:
    return message["role"], message["content"]


def render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> list[int]:
    """The chat template's token ids for `messages`."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True
        )
    except Exception as exc:  # a template raising on what it was given (jinja's errors are not one class)
        raise BadMessages(f"the chat template cannot render these messages: {exc}") from exc
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def chat_prompt(
    tokenizer,
    record: EpisodeRequests,
    messages: list[dict[str, Any]],
    content_ids: Callable[[TurnRecord], list[int]],
    tools: Any = None,
) -> tuple[list[int], int | None, bool]:
    """(prompt ids, the turn they continue or None, whether the conversation was re-rendered): the rule above.
    `content_ids(turn)`: a turn's completion without the stop token it ended on (the reply's content)."""
    rendered = render(tokenizer, messages, True, tools)
    keys = [_key(m) for m in messages]
    for turn in reversed(record.turns):
        if turn.messages is None or len(turn.messages) >= len(keys):
            continue
        earlier = [_key(m) for m in turn.messages]
        content = content_ids(turn)
        reply = tokenizer.decode(content, skip_special_tokens=False)
        if keys[: len(earlier)] != earlier or keys[len(earlier)] != ("assistant", reply):
            continue
        spliced = _splice(tokenizer, turn, content, messages[: len(earlier) + 1], rendered, tools)
        if spliced is not None:
            return spliced, turn.turn, False
        return rendered, None, True
    return rendered, None, False


def _splice(
    tokenizer, turn: TurnRecord, content: list[int], history: list[dict[str, Any]], rendered: list[int], tools: Any
) -> list[int] | None:
    """The turn's sampled tokens, then what the template adds after its reply, then the rest of `rendered`; None
    where the template does not render the history as it sampled it (rule 3)."""
    base = render(tokenizer, history[:-1], True, tools)
    full = render(tokenizer, history, False, tools)
    if full[: len(base)] != base or rendered[: len(full)] != full:
        return None
    reply = full[len(base) :]  # the reply as the template renders it, with its end-of-turn tokens
    sampled = turn.completion_ids
    if reply[: len(content)] != content:
        return None
    after = reply[len(content) :]
    if len(content) < len(sampled) and after[:1] == sampled[-1:]:
        after = after[1:]  # the template's end-of-turn token is the stop token that was sampled
    return turn.tokens + after + rendered[len(full) :]
