"""OpenEnv environments in this process (`environment.openenv`), through OpenEnvEpisode. Not collected by
`make test` itself (the name does not start with test_): tests/test_openenv.py runs this file in a child pytest
whose path has the OpenEnv overlay, which no pytest worker may have (it could import vLLM).

    PYTHONPATH=.venv/openenv-overlay:tests .venv/bin/python -m pytest -p no:xdist tests/openenv_inprocess_cases.py
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from grpo_trainer.environments import EpisodeSpec, ProtocolBreach
from grpo_trainer.environments.openenv import build
from grpo_trainer.errors import ConfigError
from grpo_trainer.environments.tools import parse_tool_calls
from openenv_loop import END, WON, call, check_a_won_episode, check_episodes_resume_under_async, play

ENVS = "tests/openenv_envs.py"


def environment(cls: str = "GuessEnv", **options):
    """The `environment.openenv` kind as build() makes it from a config (only its `environment` section is read)."""
    section = {"openenv": f"{ENVS}:{cls}", "action": None, "kwargs": {}, "action_tool": None, "observation_field": None,
               **options}
    return build(SimpleNamespace(environment=SimpleNamespace(**section)))


def spec(seed: int = 5, **row) -> EpisodeSpec:
    return EpisodeSpec({"prompt": "Play.", **row}, seed=seed, episode_id="s1-d0-p0", extend_prompt=lambda text: [])


def turn(episode, text: str):
    return episode.respond(text, parse_tool_calls(text))


def test_the_action_class_comes_from_steps_type_hint_and_becomes_one_tool():
    env = environment()
    assert env.action_cls.__name__ == "GuessAction" and env.has_reward
    assert env.tools == [{"type": "function", "function": {
        "name": "guess", "description": "Guess the number.",
        "parameters": {"type": "object", "properties": {"guess": {"title": "Guess", "type": "integer"}}, "required": ["guess"]}}}]
    assert environment(action_tool="pick").tools[0]["function"]["name"] == "pick"
    assert environment(action=f"{ENVS}:ChatAction").action_cls.__name__ == "ChatAction"
    with pytest.raises(ConfigError, match=r"^environment.action tests/openenv_envs.py:GuessEnv: not a pydantic model"):
        environment(action=f"{ENVS}:GuessEnv")


def test_an_episode_plays_by_tool_calls_and_plain_json_and_model_mistakes_are_messages():
    episode = environment().episode()
    assert episode.reset(spec(seed=5, hint="Be quick.", level=3), 0) == "Guess my number from 1 to 8. Be quick."
    assert episode.obj.state.episode_id == "s1-d0-p0-g0" and episode.obj.state.seed == 5
    secret = random.Random(5).randint(1, 8)
    wrong = 1 if secret > 1 else 2
    first = turn(episode, call(wrong))
    assert first.messages == [{"role": "tool", "name": "guess", "content": "higher" if wrong < secret else "lower"}]
    assert (first.done, first.reward, first.tool_calls) == (False, 0.0, 1)
    mistakes = {
        call('"abc"'): ("tool", "error: invalid action: guess: Input should be a valid integer"),
        call(3, name="shout"): ("tool", "error: unknown tool 'shout'; the tool is 'guess'"),
        call(3) + call(4): ("tool", "error: one action per turn; this turn made 2 tool calls"),
        '<tool_call>{"name": "guess"': ("tool", "error: the tool call is not closed"),
        "five?": ("user", "error: no action: call the tool 'guess', or reply with a JSON object of its arguments"),
        '{"guess": 3, "why": "x"}': ("user", "error: invalid action: why: Extra inputs are not permitted"),
    }
    for text, (role, says) in mistakes.items():
        reply = turn(episode, text)
        assert reply.invalid_actions == 1 and not reply.done and reply.reward is None, text
        assert reply.messages[0]["role"] == role and reply.messages[0]["content"].startswith(says), (text, reply)
    assert episode.obj.state.step_count == 1  # none of them reached the environment
    hit = turn(episode, f'{{"guess": {secret}}}')
    assert hit.messages == [{"role": "user", "content": "yes"}] and hit.done and hit.reward == 1.0
    assert episode.reward() == 1.0 and episode.snapshot() is episode.obj
    episode.close()


def test_no_step_reward_is_no_opinion_and_a_reset_that_says_done_leaves_one_turn():
    episode = environment().episode()
    episode.reset(spec(over=True), 0)
    assert turn(episode, call(3)).done and episode.obj.state.step_count == 0 and episode.reward() is None


@pytest.mark.parametrize("guess, error, says", [
    (13, ValueError, "unlucky 13"),
    (16, ProtocolBreach, "GuessEnv.step returned an observation whose done is 'yes'; expected true or false"),
    (17, ProtocolBreach, "GuessEnv.step returned an observation whose reward is nan; expected a finite number or null"),
])
def test_a_hostile_step_raises_for_the_loop_to_fail_the_episode(guess, error, says):
    episode = environment().episode()
    episode.reset(spec(), 0)
    with pytest.raises(error, match=f"^{says}$"):
        turn(episode, call(guess))


def test_a_huge_observation_is_passed_whole_for_the_loop_to_cut():
    import openenv_envs

    episode = environment().episode()
    episode.reset(spec(), 0)
    assert len(turn(episode, call(15)).messages[0]["content"]) == openenv_envs.HUGE_CHARS


def test_a_single_text_field_takes_a_plain_reply_and_reset_gets_every_column_with_kwargs():
    episode = environment("ChatEnv").episode()
    assert episode.reset(spec(level=3), 0) == "columns: ['level', 'prompt']"  # seed and episode_id: reset's own
    first = turn(episode, "hello there")
    assert first.messages == [{"role": "user", "content": "you said 'hello there'"}] and not first.done
    second = turn(episode, '{"message": "bye"}')
    assert second.messages[0]["content"] == "you said 'bye'" and second.done
    assert episode.reward() == 1.0  # 0.5 + 0.5
    turned = environment("ChatEnv", observation_field="turn").episode()
    turned.reset(spec(), 0)
    assert turn(turned, "hi").messages == [{"role": "user", "content": "1"}]


def test_in_process_and_remote_episodes_are_the_same():
    """The same environment, seed and replies give the same messages, rewards and ends in this process and over
    /ws (the server of tests/test_openenv.py)."""
    from grpo_trainer.environments.openenv_ws import OpenEnvRemote

    url = os.environ.get("GRPO_TRAINER_OPENENV_URL")
    if url is None:
        pytest.skip("run by tests/test_openenv.py, which starts the server")
    remote = OpenEnvRemote(url, sessions=1, step_timeout=5, reconnect_timeout=5, max_message_mb=1)
    local = environment()
    assert remote.tools == local.tools
    replies = [call(4), '{"guess": "x"}', "{\"guess\": 6}", call(2), call(7), call(5)]
    for seed in range(4):
        played = []
        for env in (local, remote):
            episode = env.episode()
            script = [episode.reset(spec(seed=seed, hint="Go.", level=1), 2)]
            for text in replies:
                reply = turn(episode, text)
                script.append((reply.messages, reply.done, reply.reward, reply.invalid_actions))
                if reply.done:
                    break
            script.append(episode.reward())
            episode.close()
            played.append(script)
        assert played[0] == played[1], seed
    remote.close()


def test_in_process_episodes_through_the_loop():
    """The episode loop with the class in process: a won episode as the loop records it, the object itself for
    the rewards; a step that raises, and one that hangs past environment.step_timeout, end their episodes."""
    out, tokenizer = play(environment(), WON)
    check_a_won_episode(out, tokenizer)
    assert type(out.environments[0]).__name__ == "GuessEnv" and out.environments[0].state.step_count == 2
    raised, _ = play(environment(), [call(13) + END, "never"])
    assert [(r.ended_by, r.error) for r in raised.episodes] == [("error", "respond: ValueError: unlucky 13")] * 2
    env = environment()
    envs = env.env_cls.step.__globals__  # tests/openenv_envs.py as the loader imported it (by path, as grpo_user_openenv_envs)
    hangs = envs["Hangs"]
    hangs.seconds = 60.0
    hangs.release.clear()
    try:
        hung, _ = play(env, [call(14) + END, "never"], step_timeout=0.5)
        assert [r.ended_by for r in hung.episodes] == ["timeout"] * 2
        # Both steps are still hanging when the loop has ended their episodes: abandoned at step_timeout, not
        # waited out (a loop that waited would return only once they ended, a minute later, and find none running).
        assert hangs.running == 2
    finally:
        hangs.release.set()
        hangs.seconds = envs["HANG_SECONDS"]


def test_in_process_episodes_play_under_async_rollouts_and_resume_with_their_objects(tmp_path):
    """environment.openenv under rollout.max_staleness 1: the objects are saved with the checkpoint's batches."""
    check_episodes_resume_under_async(environment(), tmp_path)
