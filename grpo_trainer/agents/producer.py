"""The producer seam: agent programs whose requests to the token endpoint are the episodes a run trains on.

A `Player` is one kind of agent program (`environment.agent`'s solve function, solve.py; a verifiers environment,
`environment.verifiers`). The run's `AgentEngine` (engine.py) owns the endpoint and everything around the player:
for every slot of a step (G per prompt) it opens one endpoint episode, calls `player.play(row, episode, seed)`,
closes the episode, and turns what the endpoint recorded (or the branches the player returns) into one training
row. A player only plays: it never sees the engine, the batch, the advantages or the other slots.

    class Player(Protocol):
        name: str                                   # names the config key in messages: "environment.agent x.py:solve"
        async def play(self, row: dict, episode: EpisodeHandle, seed: int) -> Played: ...

Optional members, read with getattr (a player may leave them out):

- `serving()`: an async context manager entered once per run (per rank), on the loop the plays run on, before the
  first play, and left when the run ends (a server the player's episodes share, verifiers' `env.serving()`).
- `counter_names: tuple[str, ...]`: the names of `Played.counters` summed over the batch and logged (as
  `environment/agent/<name>`); other names are dropped. Declared, so every rank logs the same names.
- `stop_conditions: tuple[str, ...]`: the values `Played.stop_condition` may take, each episode counted under its
  own (`environment/agent/stop/<name>`, summed over the batch and the ranks), with `none` (no stop condition given,
  or the episode failed before it returned) and `other` (a value not declared). Declared, so every rank logs the
  same names; a player that declares none gets no stop counts.
- `reward_names: dict[str, float]`: the named rewards `Played.reward` may hold as a dict, with their weights
  (`environment.reward_weights` for environment.agent); each becomes a reward `environment/<name>`.

`play` runs on the engine's players' loop (one asyncio loop per rank, `environment.concurrency` plays at once). It
may raise, hang, or be cancelled at `environment.episode_timeout` (the agent's own time: wall time minus the time
its requests spent in the endpoint): the engine turns each of those into a failed episode (scored by
`environment.on_error`), never into an error of the run. A player that does not raise but knows its episode failed
says so with `Played(ok=False, error=...)`.

`EpisodeHandle` (endpoint.py) is what the program needs: `base_url` (".../v1"), `api_key` (the episode's own key),
`model` and `session_id` (for `X-Session-ID`, with the endpoint's run key, if the program prefers). `seed` is the
episode's own seed, for the program's randomness: a function of the group's seed and the slot's position in its group.
The endpoint seeds every request itself, from (run seed, group, slot, turn) (endpoint.py), never from arrival order.

What is trained (engine.py): every one of the episode's `branches` (records.py `Branch`: prompt ids, completion ids,
a loss mask that is 1 on sampled tokens only, the sampler's log-probs aligned with it); None, the usual case,
means the endpoint's own record of the episode's requests (`EpisodeRequests.branches()`). The LAST branch, the one
that ended the episode and that the reward judged, is the episode's completion (what the reward functions and the
completions log see); an episode with several branches (a re-rendered turn, or a program that started a second
conversation) trains each earlier one too, as a sample of its own with the episode's advantage
(`environment/agent/branch_rows` counts them; docs/agents.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .endpoint import EpisodeHandle
from .records import Branch

__all__ = ["Branch", "EpisodeHandle", "Played", "Player"]


@dataclass
class Played:
    """How one episode went, as its player tells it.

    `reward`: the episode's `environment` reward (a number; None: no opinion), or a dict of named rewards, each
    `environment/<name>` (the names the player declares in `reward_names`). `branches`: what to train on (None: the
    endpoint's own record of the episode's requests). `messages`: the episode's conversation as the reward functions
    receive it (`completions`; None: the endpoint's record of the last chat request and its reply, else the decoded
    completion as one assistant message). `ok=False` (with a one-line `error`): the episode failed, scored by
    environment.on_error. `stop_condition`: why it ended, in the player's words (kept on the episode's record;
    counted per name where the player declares `stop_conditions`).
    `counters`: numbers summed over the batch (only the names in the player's `counter_names` are logged)."""

    reward: float | dict[str, float] | None
    branches: list[Branch] | None = None  # None: train on the endpoint's own record of the episode's requests
    messages: list[dict[str, Any]] | None = None
    ok: bool = True
    error: str | None = None
    stop_condition: str | None = None
    counters: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Player(Protocol):
    """One kind of agent program; see the module docstring (and its optional members)."""

    name: str

    async def play(self, row: dict[str, Any], episode: EpisodeHandle, seed: int) -> Played:
        """Play one episode against the endpoint: `row` is the dataset row (a copy of its own), `episode` where and
        with which key to call, `seed` the episode's seed."""
        ...


class PlayerEnvironment:
    """A player as the run's environment (`build_environment`'s result for environment.agent and the other player
    kinds): what the task reads of an environment (name, no tool schemas, a reward), and the player itself, which
    `with_environment` hands to an `AgentEngine` (engine.py). It makes no `Episode` objects: its episodes are played
    by the engine, not by the environment loop. A new kind registers `module:build` in environments.KINDS, its build
    returning `PlayerEnvironment(MyPlayer(...))`."""

    tools: list[dict[str, Any]] = []
    capacity: int | None = None

    def __init__(self, player: Player):
        self.player = player
        self.name = player.name
        self.reward_names: dict[str, float] = dict(getattr(player, "reward_names", None) or {})
        # Without named rewards, the `environment` reward (the task adds it where has_reward).
        self.has_reward = not self.reward_names

    def counters(self) -> dict[str, int]:
        return {}

    def episode(self) -> Any:
        raise TypeError(f"{self.name}: its episodes are played by the agent engine, not the environment loop")

    def close(self) -> None:
        """Nothing: the engine leaves the player's `serving()` when it closes."""
