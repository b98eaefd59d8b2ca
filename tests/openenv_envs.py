"""OpenEnv environments for tests/test_openenv.py, and their servers. Imports openenv: only processes started with
the OpenEnv overlay on their PYTHONPATH import this file (tests/openenv_overlay.py says why).

`GuessEnv`: guess a number from 1 to 8 (the secret drawn from reset's seed), told higher or lower; reward 1 for
the hit, 0 for a miss; done on the hit or after four guesses. Some numbers make it hostile, one property each:

    13  its step raises ValueError            16  lies about done (done="yes", unvalidated)
    14  its step hangs for HANG_SECONDS       17  a NaN reward
    15  a huge observation (HUGE_CHARS)       99  kills its process (a server that drops every connection)

Its reset takes `hint` (a dataset column, shown in the first observation) and `over` (done at reset); other
columns are not in its signature. `ChatEnv`: an Action with one required text field (plain replies are its
messages), echoing them back.

    python tests/openenv_envs.py PORT [PORT_SINGLE]   # GuessEnv on 127.0.0.1:PORT (32 sessions), and with
                                                      # the default capacity of one session on PORT_SINGLE
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

HANG_SECONDS = 4.0
HUGE_CHARS = 2 * 2**20  # over the 1 MiB max_message_mb the tests give the client


class Hangs:
    """Step 14's hangs in this process: `running` counts the steps still in theirs; each lasts `seconds` or until
    `release` is set (an in-process test holds them longer, sees them still running, then lets them go)."""

    seconds = HANG_SECONDS
    release = threading.Event()
    lock = threading.Lock()
    running = 0

    @classmethod
    def hang(cls) -> None:
        with cls.lock:
            cls.running += 1
        try:
            cls.release.wait(cls.seconds)
        finally:
            with cls.lock:
                cls.running -= 1


class GuessAction(Action):
    """Guess the number."""

    guess: int


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, hint: str = "", over: bool = False) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, 8)
        self._state = State(episode_id=episode_id, step_count=0, seed=seed)
        return GuessObservation(feedback=f"Guess my number from 1 to 8.{' ' + hint if hint else ''}", done=over)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        n = action.guess
        if n == 13:
            raise ValueError("unlucky 13")
        if n == 14:
            Hangs.hang()
        if n == 15:
            return GuessObservation(feedback="x" * HUGE_CHARS)
        if n == 16:
            return GuessObservation.model_construct(feedback="sure", done="yes", reward=0.0, metadata={})
        if n == 17:
            return GuessObservation(feedback="what", reward=float("nan"))
        if n == 99:
            os._exit(3)
        if n == self.secret:
            return GuessObservation(feedback="yes", done=True, reward=1.0)
        word = "higher" if n < self.secret else "lower"
        return GuessObservation(feedback=word, done=self._state.step_count >= 4, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class ChatAction(Action):
    message: str


class ChatObservation(Observation):
    reply: str = ""
    turn: int = 0


class ChatEnv(Environment):
    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> ChatObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return ChatObservation(reply=f"columns: {sorted(kwargs)}")

    def step(self, action: ChatAction, timeout_s=None, **kwargs) -> ChatObservation:
        self._state.step_count += 1
        return ChatObservation(reply=f"you said {action.message!r}", turn=self._state.step_count,
                               reward=0.5, done=self._state.step_count >= 2)

    @property
    def state(self) -> State:
        return self._state


async def serve(ports: list[int]) -> None:
    import uvicorn

    apps = [create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=32),
            create_app(GuessEnv, GuessAction, GuessObservation)]  # OpenEnv's default: one session
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws_max_size=2**26))
               for app, port in zip(apps, ports)]
    await asyncio.gather(*(s.serve() for s in servers))


def exit_with_parent() -> None:
    """End this server when the test process that started it is gone (killed before it could stop us)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


if __name__ == "__main__":
    threading.Thread(target=exit_with_parent, daemon=True).start()
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
