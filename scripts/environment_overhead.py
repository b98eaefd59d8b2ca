"""How long environments take in the episode loop: 64 episodes (8 prompts x 8) whose `step` sleeps 50 ms, three
answered turns each, run with environment.concurrency 64 and 1.

    PYTHONPATH=. python scripts/environment_overhead.py

The model is the tests' scripted stand-in (tests/test_environments.py: no sampling), so the time printed is the
loop's environment calls alone: making the objects, reset, three steps, get_reward, close. With 64 threads the
three 50 ms sleeps of every episode overlap; one at a time they add up (64 x 3 x 50 ms = 9.6 s).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_environments import END, ScriptedModel, _prompt, _tokenizer  # noqa: E402

from grpo_trainer.environments import EpisodeSpec  # noqa: E402
from grpo_trainer.environments.class_env import ClassEnvironment  # noqa: E402
from grpo_trainer.environments.episodes import EpisodeEngine, EpisodeSettings  # noqa: E402

PROMPTS, G, STEP_SECONDS, TURNS = 8, 8, 0.05, 3


class Sleepy:
    def reset(self, **row) -> None:
        self.answered = 0

    def step(self, reply: str) -> tuple[str, bool]:
        time.sleep(STEP_SECONDS)
        self.answered += 1
        return "again", self.answered >= TURNS


def main() -> None:
    tokenizer = _tokenizer()
    keys = [f"k{i}" for i in range(PROMPTS)]
    for concurrency in (64, 1):
        env = ClassEnvironment(Sleepy, "environment.factory overhead:Sleepy", {}, extra_tools=[], tool_timeout=5)
        settings = EpisodeSettings(max_turns=TURNS + 1, step_timeout=5, episode_timeout=60, concurrency=concurrency,
                                   observation_chars=100, record=True)
        model = ScriptedModel(tokenizer, {k: ["1" + END] * (TURNS + 1) for k in keys})
        engine = EpisodeEngine(model, env, tokenizer, eos_token_ids=[tokenizer.eos_token_id], max_completion_length=400,
                               settings=settings)
        specs = [EpisodeSpec({"prompt": k}, 1, k, lambda text: None) for k in keys]
        started = time.perf_counter()
        out = engine.generate([_prompt(tokenizer, k) for k in keys], G, episodes=specs)
        wall = time.perf_counter() - started
        assert all(e.ended_by == "environment" and e.turns == TURNS for e in out.episodes)
        print(f"concurrency {concurrency:2d}: {len(out.episodes)} episodes x {TURNS} steps of {STEP_SECONDS * 1000:.0f} ms: "
              f"{out.env_seconds:.2f} s in environment calls, {wall:.2f} s wall")
        engine.calls.close()


if __name__ == "__main__":
    main()
