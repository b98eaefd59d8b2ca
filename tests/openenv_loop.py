"""GuessEnv (tests/openenv_envs.py) played through the episode loop (EpisodeEngine) with a scripted model, for
either OpenEnv kind: tests/test_openenv.py runs it over /ws, tests/openenv_inprocess_cases.py in process. No
openenv import here."""

from __future__ import annotations

import functools
import random

from grpo_trainer.config import ModelConfig
from grpo_trainer.environments import EpisodeSpec
from grpo_trainer.models import load_tokenizer
from grpo_trainer.rollout import Rollout, SamplesTrainingModel
from grpo_trainer.environments.episodes import EpisodeEngine, EpisodeSettings

END = "<|im_end|>"
SEED = 5
SECRET = random.Random(SEED).randint(1, 8)  # GuessEnv's secret for the group's seed
WRONG = 1 if SECRET > 1 else 2


def call(guess, name: str = "guess") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"guess": {guess}}}}}</tool_call>'


class ScriptedModel(SamplesTrainingModel):
    """A stand-in engine: model turn k of every conversation is script[k] (sampling log-probs -0.5)."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None):
        turns = [self.script[self.tokenizer.decode(c).count("<|im_start|>assistant") - 1]
                 for c in prompt_ids for _ in range(num_generations)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        return Rollout(completion_ids=ids, truncated=[False] * len(ids), sampling_logprobs=[[-0.5] * len(t) for t in ids])


@functools.cache
def tiny_tokenizer():
    return load_tokenizer(ModelConfig())


def prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def play(environment, script: list[str], groups: int = 1, g: int = 2, step_timeout: float = 1.0):
    """`groups` prompts x `g` episodes of `environment` (GuessEnv, seed SEED) under `script`: (Rollout, tokenizer)."""
    tokenizer = tiny_tokenizer()
    settings = EpisodeSettings(max_turns=4, step_timeout=step_timeout, episode_timeout=30.0, concurrency=8,
                               observation_chars=200, record=True)
    engine = EpisodeEngine(ScriptedModel(tokenizer, script), environment, tokenizer,
                           eos_token_ids=[tokenizer.eos_token_id], max_completion_length=400, settings=settings)
    specs = [EpisodeSpec({"prompt": "Play."}, SEED, f"s1-d0-p{i}", lambda text: prompt(tokenizer, f"Play.\n{text}"))
             for i in range(groups)]
    return engine.generate([prompt(tokenizer, "Play.")] * groups, g, episodes=specs), tokenizer


WON = [call(WRONG) + END, f'{{"guess": {SECRET}}}' + END]  # the script of check_a_won_episode


def check_a_won_episode(out: Rollout, tokenizer) -> None:
    """What the loop made of [a wrong guess by tool call, the right one as plain JSON]: the reset text extends
    the prompt; the tool call is answered by a tool message, the plain reply's answer ends the episode (kept for
    the rewards, no tokens); environment tokens are masked; the environment's reward is the steps' sum."""
    assert out.prompt_ids[0] == prompt(tokenizer, "Play.\nGuess my number from 1 to 8.")
    messages = out.conversations[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "user"]
    assert messages[1] == {"role": "tool", "name": "guess", "content": "higher" if WRONG < SECRET else "lower"}
    assert messages[3] == {"role": "user", "content": "yes"}
    record = out.episodes[0]
    assert (record.ended_by, record.env_reward, record.turns, record.error) == ("environment", 1.0, 2, None)
    ids, mask = out.completion_ids[0], out.completion_mask[0]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == call(WRONG) + END + f'{{"guess": {SECRET}}}' + END
    assert messages[1]["content"] in tokenizer.decode([t for t, m in zip(ids, mask) if not m])


def check_episodes_resume_under_async(environment, folder) -> None:
    """`environment` under rollout.max_staleness 1 (GuessEnv, this module's scripted model, the won script): each
    batch's episodes play in the rollout queue's thread; a checkpoint after step 2 holds batch 3 with what the
    reward functions get as `environments` (the object in process, the server's snapshot over /ws), and the
    resumed queue trains the uninterrupted run's episodes, those included (test_async.py's stand-in run)."""
    from types import SimpleNamespace

    from helpers import rollout_queue
    from test_async import drive, server_run, stopped_and_resumed

    tokenizer = tiny_tokenizer()
    settings = EpisodeSettings(max_turns=4, step_timeout=5.0, episode_timeout=30.0, concurrency=8,
                               observation_chars=200, record=True)

    def run():
        engine = EpisodeEngine(ScriptedModel(tokenizer, WON), environment, tokenizer,
                               eos_token_ids=[tokenizer.eos_token_id], max_completion_length=400, settings=settings)
        r = server_run(1, 4, engine=engine)
        r.task = SimpleNamespace(
            prompt_ids=lambda indices: [prompt(tokenizer, "Play.") for _ in indices],
            episode_spec=lambda index, seed, episode_id: EpisodeSpec(
                {"prompt": "Play."}, SEED, episode_id, lambda text: prompt(tokenizer, f"Play.\n{text}")))
        r.rollouts = rollout_queue(r)
        return r

    def seen(steps):
        def state(o):  # the in-process object's pydantic State, or the remote snapshot's plain data
            return o.state.model_dump() if hasattr(o.state, "model_dump") else vars(o)
        return [(mine, r.completion_ids, [(e.ended_by, e.env_reward) for e in r.episodes],
                 [state(o) for o in r.environments]) for mine, r, _ in steps]

    straight = seen(drive(run()))
    assert all(ended == [("environment", 1.0)] * len(ended) for _, _, ended, _ in straight)  # every episode won
    assert seen(stopped_and_resumed(run, folder)) == straight
