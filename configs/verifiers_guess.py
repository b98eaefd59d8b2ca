"""Guess-a-number as a verifiers 0.4 environment (v1 Taskset + Env), for `environment.verifiers`.

The game of builtin:tiny-guess and configs/guess_number_env.py: a number from 1 to 8, four guesses, each plain
reply answered "higher, 5-8" / "lower, 1-3" / "yes" (anything else: "say a number, 1-8"); reward 1 if found. The
taskset yields the 96 games of builtin:guess_number's test split (each secret 12 times); the trainer's `data:`,
when given, wins over it (docs/agents.md). The player's harness runs in process (grpo_trainer/agents/vf_harness.py):
nothing is downloaded, nothing leaves the machine. Trained by configs/verifiers_guess_cpu.yaml.
"""

from __future__ import annotations

import verifiers.v1 as vf

from grpo_trainer.agents.vf_harness import InProcessChatHarness

__all__ = ["GuessTaskset", "GuessEnv", "InProcessChatHarness"]

PROMPT = "Guess my number, 1-8"
LOW, HIGH, GUESSES = 1, 8, 4


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def won(self, trace) -> float:
        return float(trace.info.get("won", 0.0))

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(trace.info.get("guesses", 0))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i in range(96):
            yield GuessTask(GuessData(prompt=PROMPT, secret=LOW + i % (HIGH - LOW + 1)), self.config.task)


def answer(reply: str, secret: int, low: int, high: int) -> tuple[str, int, int, bool]:
    """The game's answer to one reply: (text, range left, found)."""
    text = reply.strip()
    if not (text.isdigit() and LOW <= int(text) <= HIGH):
        return f"say a number, {low}-{high}", low, high, False
    guess = int(text)
    if guess == secret:
        return "yes", low, high, True
    low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
    return f"{'higher' if guess < secret else 'lower'}, {low}-{high}", low, high, False


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret, low, high = task.data.secret, LOW, HIGH
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            for guess in range(1, GUESSES + 1):
                if segment.terminated:
                    break
                text, low, high, found = answer(segment.last_reply, secret, low, high)
                game.trace.info.update(won=float(found), guesses=guess)
                if found or guess == GUESSES:
                    break
                segment = await game.turn(text)
