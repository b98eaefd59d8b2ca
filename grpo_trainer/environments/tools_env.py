"""The built-in stateless environment: `environment.tools` (user functions and the sandboxed `python`) on the episode loop.

Nothing to reset and nothing to score: a turn with tool calls is answered with their results (all of a turn's
calls at once, `ToolBox.run`: time-limited by environment.tool_timeout, never raising), a turn without calls ends the
episode. With `environment.max_tool_turns` rounds of calls, an episode has at most max_tool_turns + 1 model turns.
This reproduces the tool loop that came before environments exactly (same conversations, tokens and seeds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .protocol import EpisodeSpec, Reply
from .tools import ToolBox, ToolCall, ToolResult, build_toolbox, tool_message

if TYPE_CHECKING:
    from ..config import Config

NAME = "environment.tools"


class ToolsEpisode:
    """The `Episode` protocol over a tool box; holds no state of its own."""

    def __init__(self, box: ToolBox):
        self.box = box
        self.tools = box.schemas

    def reset(self, spec: EpisodeSpec, j: int) -> str | None:
        return None

    def respond(self, text: str, calls: list[ToolCall | ToolResult]) -> Reply:
        if not calls:
            return Reply([])
        results = self.box.run(calls)
        return Reply(
            messages=[tool_message(r.name, r.output) for r in results],
            tool_calls=len(results),
            tool_errors=sum(r.error for r in results),
        )

    def reward(self) -> float | None:
        return None

    def snapshot(self) -> Any:
        return None

    def close(self) -> None:
        pass


class ToolsEnvironment:
    """The `Environment` protocol for `environment.tools` alone."""

    name = NAME
    has_reward = False
    capacity: int | None = None  # stateless: no limit

    def __init__(self, box: ToolBox):
        self.box = box
        self.tools = box.schemas

    def counters(self) -> dict[str, int]:
        return {}

    def episode(self) -> ToolsEpisode:
        return ToolsEpisode(self.box)

    def close(self) -> None:
        pass


def build(cfg: Config) -> ToolsEnvironment:
    box = build_toolbox(cfg.environment)
    assert box is not None, "the tools environment is built only where environment.tools names some"
    return ToolsEnvironment(box)
