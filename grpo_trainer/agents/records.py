"""What the token endpoint records of each episode: every request token for token, for the producers to train on.

An episode is one agent program's run against the endpoint (one `X-Session-ID`, or one episode key). Each request
it makes is a `TurnRecord`: the prompt ids the policy was run on, the completion ids it sampled, the sampler's
log-prob of each, the finish reason, and the earlier turn it continues (`parent`), if any. A turn continues an
earlier one when its prompt starts with that turn's prompt + completion (the token route: what the agent sent; the
chat route: the endpoint splices the sampled ids back in, chat.py). Turns form a tree; each root-to-leaf path is
one branch (`EpisodeRequests.branches`): the leaf's prompt + completion, the sampled tokens of every turn on the path
in the loss mask, everything else (the first prompt, what the agent or its tools added between turns) masked out. A
turn whose conversation was re-rendered differently from what was sampled starts a new root, never spliced into the
earlier one. Every branch is trained, as a sample of its own with the episode's advantage (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rollout import Branch

__all__ = ["Branch", "EpisodeRequests", "TurnRecord"]


@dataclass
class TurnRecord:
    """One request served: what the policy was given and what it sampled."""

    turn: int  # the request's position in its episode (arrival order), part of its seed
    route: str  # "generate" (the token route) or "chat"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the sampler's, one per completion token
    finish_reason: str  # "stop" | "length"
    seed: int
    parent: int | None = None  # the earlier turn this one continues (its prompt starts with that turn's tokens)
    rerendered: bool = False  # chat: the messages extend an earlier turn, but their rendering differs from it
    messages: list[dict[str, Any]] | None = None  # chat: the request's messages (for the rewards)

    @property
    def tokens(self) -> list[int]:
        """The turn's whole sequence: prompt + completion."""
        return self.prompt_ids + self.completion_ids


@dataclass
class EpisodeRequests:
    """Everything one episode asked of the endpoint. Read by the producers once the episode is closed."""

    session_id: str
    step: int
    index: int  # the episode's position in its step, part of its requests' seeds
    budget: int  # completion tokens the whole episode may sample (rollout.max_completion_length)
    api_key: str = field(repr=False, default="")  # the episode's own bearer key: never printed, never logged
    turns: list[TurnRecord] = field(default_factory=list)
    rerendered_turns: int = 0  # agent/rerendered_turns
    refused: dict[str, int] = field(default_factory=dict)  # refused requests by reason (error code)
    next_turn: int = 0  # requests admitted so far (a refused one takes no turn)
    sampler_seconds: float = 0.0  # time with a request of the episode in the endpoint (set when it is closed)

    @property
    def tokens_used(self) -> int:
        """Completion tokens sampled so far: what the budget is spent on."""
        return sum(len(t.completion_ids) for t in self.turns)

    def find_parent(self, prompt_ids: list[int]) -> int | None:
        """The newest turn whose prompt + completion the new prompt starts with (None: a new root)."""
        for record in reversed(self.turns):
            tokens = record.tokens
            if len(tokens) <= len(prompt_ids) and prompt_ids[: len(tokens)] == tokens:
                return record.turn
        return None

    def turn(self, number: int) -> TurnRecord:
        return next(t for t in self.turns if t.turn == number)

    def branches(self) -> list[Branch]:
        """One sample per root-to-leaf path of the turn tree, leaves in the order they were served."""
        parents = {t.parent for t in self.turns if t.parent is not None}
        out = []
        for leaf in self.turns:
            if leaf.turn in parents:
                continue
            path = [leaf]
            while path[-1].parent is not None:
                path.append(self.turn(path[-1].parent))
            path.reverse()
            root = path[0]
            tokens = leaf.tokens
            mask = [0] * len(tokens)
            logprobs = [0.0] * len(tokens)
            for t in path:
                start = len(t.prompt_ids)
                for j, value in enumerate(t.logprobs):
                    mask[start + j] = 1
                    logprobs[start + j] = value
            cut = len(root.prompt_ids)
            out.append(
                Branch(
                    prompt_ids=list(root.prompt_ids),
                    completion_ids=tokens[cut:],
                    completion_mask=mask[cut:],
                    logprobs=logprobs[cut:],
                    turns=[t.turn for t in path],
                    truncated=leaf.finish_reason == "length",
                )
            )
        return out
