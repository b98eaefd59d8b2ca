"""Environments (issue 37): the episode loop with a TRL-style class, hostile environments, the failure policy,
timeouts and concurrency, rewards that receive the episodes, the config; one CLI run on the tiny model (slow).

The loop tests drive EpisodeEngine with a scripted engine (no model): what the model "says" is fixed, so every
assertion is about what the loop and the environment did with it."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from grpo_trainer.config import ModelConfig, config_from_dict
from grpo_trainer.environments import EpisodeRecord, EpisodeSpec, ProtocolBreach, environment_seed
from grpo_trainer.environments.calls import EnvCalls, EnvironmentHangs, EpisodeBudget
from grpo_trainer.environments.class_env import ClassEnvironment
from grpo_trainer.environments.openenv_ws import EnvironmentServerLost
from grpo_trainer.environments.scoring import apply_on_error, environment_metrics, environment_reward, episode_counts
from grpo_trainer.errors import ConfigError
from grpo_trainer.models import load_tokenizer
from grpo_trainer.rewards import Reward, RewardBatch
from grpo_trainer.rollout import Rollout, RunsInLockstep, SamplesTrainingModel, TakesEpisodes
from grpo_trainer.environments.episodes import EpisodeEngine, EpisodeSettings

END = "<|im_end|>"


class ScriptedModel(SamplesTrainingModel, RunsInLockstep):
    """A stand-in engine: the model's turn k in a conversation whose prompt contains `key` is scripts[key][k]
    (the same for the G completions of a group); sampling log-probs -0.5."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.calls: list[dict] = []

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        self.calls.append({"contexts": prompt_ids, "n": num_generations, "seeds": seeds})
        turns = []
        for context in prompt_ids:
            text = self.tokenizer.decode(context)
            key = next(k for k in self.scripts if f"[{k}]" in text)
            turns += [self.scripts[key][text.count("<|im_start|>assistant") - 1]] * num_generations
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        limit = max_tokens or 10_000
        return Rollout(completion_ids=[t[:limit] for t in ids], truncated=[len(t) > limit for t in ids],
                       sampling_logprobs=[[-0.5] * len(t[:limit]) for t in ids])


class Hang:
    """`step_hangs`'s step: it stays in the call until the test lets it go (`release`; at most a minute), and
    `running` counts the calls still in it, so a test sees that the loop ended their episodes without them."""

    release = threading.Event()
    lock = threading.Lock()
    running = 0

    @classmethod
    def wait(cls) -> None:
        with cls.lock:
            cls.running += 1
        try:
            cls.release.wait(60)
        finally:
            with cls.lock:
                cls.running -= 1


class Guess:
    """Guess my number from 1 to 4; a row's `mode` makes the environment misbehave in one way."""

    def reset(self, seed: int, mode: str = "fair", **row) -> str | None:
        self.secret, self.mode, self.won, self.guesses = seed % 4 + 1, mode, False, 0
        if mode == "reset_raises":
            raise RuntimeError("no such board")
        return f" Range 1-4, seed {seed}." if mode != "reset_bad" else 42

    def above(self, n: int) -> str:
        """Whether the secret number is above n.

        Args:
            n: the number to compare with
        """
        if n > 100:
            raise ValueError("too big")
        return "yes" if self.secret > n else "no"

    def step(self, reply: str):
        self.guesses += 1
        mode = self.mode
        if mode == "step_raises":
            raise KeyError("lost the board")
        if mode == "step_drops":  # what a remote environment's client raises when its connection drops
            raise ConnectionResetError("peer gone")
        if mode == "server_lost":  # a UserError: the run cannot go on
            raise EnvironmentServerLost("openenv+ws://127.0.0.1:1 went away and did not come back; stopping")
        if mode == "step_hangs":
            Hang.wait()
        if mode == "huge":
            return "x" * 1_000_000, False
        if mode == "never_done":
            return "again", False
        if mode == "bad_step":
            return "yes", "done"
        if mode == "slow":
            time.sleep(0.15)
            return "again", False
        answer = reply.split("</think>")[-1].strip()  # what follows the model's thinking, if any
        guess = int(answer) if answer.isdigit() else 0
        self.won = guess == self.secret
        return ("yes" if self.won else ("higher" if guess < self.secret else "lower")), self.won or self.guesses >= 3

    def get_reward(self) -> float:
        if self.mode == "nan_reward":
            return math.nan
        return 1.0 if self.won else 0.0


class GuessSlowToLoad(Guess):
    """Guess whose unpickling (user code a resumed run runs) waits for `loading`: module-level, so it pickles."""

    loading = threading.Event()

    def __setstate__(self, state):
        self.loading.wait(60)
        vars(self).update(state)


def _tokenizer():
    return load_tokenizer(ModelConfig())


def _prompt(tokenizer, key: str, text: str = "") -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": f"Guess [{key}].{text}"}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _spec(tokenizer, key: str, mode: str = "fair", seed: int = 2) -> EpisodeSpec:
    return EpisodeSpec({"prompt": f"Guess [{key}].", "mode": mode}, seed, f"s1-d0-p{key}",
                       lambda text: _prompt(tokenizer, key, text))


def _engine(tokenizer, scripts, factory=Guess, **settings) -> tuple[EpisodeEngine, ScriptedModel]:
    env = ClassEnvironment(factory, "environment.factory test:Guess", {}, extra_tools=[], tool_timeout=5)
    values = dict(max_turns=4, step_timeout=2.0, episode_timeout=10.0, concurrency=16, observation_chars=200, record=True)
    model = ScriptedModel(tokenizer, scripts)
    engine = EpisodeEngine(model, env, tokenizer, eos_token_ids=[tokenizer.eos_token_id], max_completion_length=600,
                           settings=EpisodeSettings(**{**values, **settings}))
    return engine, model


def test_a_class_environment_answers_tools_and_plain_replies_token_faithfully(tiny_model_path):
    """The TRL-style class: reset text extends the prompt; a tool call goes to the method (tool message), a plain
    reply to step() (user message); environment tokens are the template's, masked, log-prob 0; done ends the
    episode; get_reward is recorded; the whole conversation renders to exactly what is trained."""
    tokenizer = _tokenizer()
    call = '<tool_call>{"name": "above", "arguments": {"n": 2}}</tool_call>'
    scripts = {"a": [call + END, "1" + END, "3" + END, "never"]}  # secret: 2 % 4 + 1 = 3
    engine, model = _engine(tokenizer, scripts)
    assert engine.needs_episodes and [t["function"]["name"] for t in engine.environment.tools] == ["above"]
    out = engine.generate([_prompt(tokenizer, "a")], 2, episodes=[_spec(tokenizer, "a")])
    assert out.prompt_ids[0] == out.prompt_ids[1] == _prompt(tokenizer, "a", " Range 1-4, seed 2.")
    assert model.calls[0]["contexts"] == [out.prompt_ids[0]]  # the first turn was sampled from the extended prompt
    messages = out.conversations[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "user", "assistant", "user"]
    assert messages[1] == {"role": "tool", "name": "above", "content": "yes"} and messages[3]["content"] == "higher"
    assert messages[-1] == {"role": "user", "content": "yes"}  # the final answer: for the rewards, no tokens
    record = out.episodes[0]
    assert (record.ended_by, record.env_reward, record.turns, record.group) == ("environment", 1.0, 3, "s1-d0-pa")
    assert out.tool_calls == [1, 1] and isinstance(out.environments[0], Guess) and out.environments[0].won
    ids, mask, logprobs = out.completion_ids[0], out.completion_mask[0], out.sampling_logprobs[0]
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(logprobs, mask)) and len(ids) == len(mask)
    whole = [{"role": "user", "content": "Guess [a]. Range 1-4, seed 2."}, *messages[:-1]]
    for m in whole:
        m.pop("tool_calls", None)
    rendered = tokenizer.apply_chat_template(whole, tokenize=False)
    assert tokenizer.decode(out.prompt_ids[0] + ids) + "\n" == rendered  # the template ends the last turn with \n
    model_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert model_text == call + END + "1" + END + "3" + END


# A Qwen3-like template: assistant turns before the last user message lose their <think>...</think>.
DROPS_THINKING = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_a_template_that_rewrites_history_differs_from_what_is_trained_by_exactly_the_earlier_thinking(tiny_model_path):
    """What is trained is what the model was conditioned on while sampling: with a template that drops earlier
    <think> spans, rendering the finished conversation differs from the trained tokens by exactly those spans."""
    tokenizer = _tokenizer()
    tokenizer.chat_template = DROPS_THINKING
    engine, _ = _engine(tokenizer, {"k": ["<think>low</think>1" + END, "<think>up</think>3" + END]})
    out = engine.generate([_prompt(tokenizer, "k")], 2, episodes=[_spec(tokenizer, "k")])
    messages = out.conversations[0]
    assert [m["content"] for m in messages] == ["<think>low</think>1", "higher", "<think>up</think>3", "yes"]
    trained = tokenizer.decode(out.prompt_ids[0] + out.completion_ids[0])
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess [k]. Range 1-4, seed 2."}, *messages[:-1]], tokenize=False)
    assert "<think>low</think>" not in rendered and "<think>up</think>" in rendered
    assert trained + "\n" == rendered.replace("assistant\n1<|im_end|>", "assistant\n<think>low</think>1<|im_end|>")


def test_a_tool_method_that_raises_is_a_message_to_the_model_not_a_failure(tiny_model_path):
    tokenizer = _tokenizer()
    calls = ('<tool_call>{"name": "above", "arguments": {"n": 200}}</tool_call>'
             '<tool_call>{"name": "above", "arguments": {"m": 1}}</tool_call><tool_call>{oops}</tool_call>')
    engine, _ = _engine(tokenizer, {"t": [calls + END, "3" + END]})
    out = engine.generate([_prompt(tokenizer, "t")], 2, episodes=[_spec(tokenizer, "t")])
    told = [m["content"] for m in out.conversations[0] if m["role"] == "tool"]
    assert told[0] == "error: ValueError: too big" and told[1].startswith("error: bad arguments for above")
    assert "not valid JSON" in told[2]
    assert out.tool_calls[0] == 3 and out.tool_errors[0] == 3 and out.episodes[0].invalid_actions == 1
    assert out.episodes[0].ended_by == "environment" and out.episodes[0].env_reward == 1.0


def test_hostile_environments_end_their_own_episode_and_say_why(tiny_model_path):
    """One batch, one misbehaving environment per group: each ends its own episodes, recorded and one line; the
    fair group plays on; a hang is abandoned at step_timeout; a huge message is cut and counted."""
    tokenizer = _tokenizer()
    modes = ["fair", "reset_raises", "reset_bad", "step_raises", "step_hangs", "huge", "never_done", "bad_step",
             "nan_reward"]
    scripts = {mode: ["3" + END] * 4 for mode in modes}
    engine, _ = _engine(tokenizer, scripts, step_timeout=0.5, max_turns=3)
    Hang.release.clear()
    try:
        out = engine.generate([_prompt(tokenizer, m) for m in modes], 2,
                              episodes=[_spec(tokenizer, m, m) for m in modes])
        # Both hung steps are still in their call when generate has returned: abandoned, not waited out (a loop
        # that waited would return only once they ended, a minute later, and find none running).
        assert Hang.running == 2
    finally:
        Hang.release.set()
    got = {m: out.episodes[2 * i] for i, m in enumerate(modes)}
    assert got["fair"].ended_by == "environment" and got["fair"].env_reward == 1.0
    assert got["reset_raises"].ended_by == "error" and "RuntimeError: no such board" in got["reset_raises"].error
    assert got["reset_bad"].ended_by == "error" and "Guess.reset returned 42" in got["reset_bad"].error
    assert got["step_raises"].ended_by == "error" and "KeyError" in got["step_raises"].error
    assert got["step_hangs"].ended_by == "timeout" and "step_timeout" in got["step_hangs"].error
    assert got["step_hangs"].env_reward is None and out.environments[8] is None  # the hung object is never touched
    assert got["huge"].ended_by == "turns" and got["huge"].observations_cut == 2 and got["huge"].turns == 3
    assert len(out.conversations[10][1]["content"]) < 300
    assert got["never_done"].ended_by == "turns" and got["never_done"].turns == 3
    assert got["bad_step"].ended_by == "error" and "expected (feedback: str, done: bool)" in got["bad_step"].error
    assert got["nan_reward"].ended_by == "error" and "finite number" in got["nan_reward"].error
    for i, m in enumerate(modes):  # a failure from the start is still sampled (one turn) but never answered
        assert out.episodes[2 * i + 1].ended_by == got[m].ended_by
    assert out.turns[2] == 1 and out.completion_mask[2] == [1] * len(out.completion_ids[2])


def test_an_episode_budget_counts_environment_time_only(tiny_model_path):
    """Steps of 0.15 s within a 0.4 s episode budget: the third step runs into it (`timeout`, episode)."""
    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {"s": ["1" + END] * 6}, max_turns=6, episode_timeout=0.4)
    out = engine.generate([_prompt(tokenizer, "s")], 2, episodes=[_spec(tokenizer, "s", "slow")])
    assert out.episodes[0].ended_by == "timeout" and "episode_timeout" in out.episodes[0].error
    assert 2 <= out.episodes[0].turns <= 4


def test_episodes_run_concurrently():
    """64 calls, three rounds, each call waiting at a barrier of 64 before it returns: a round passes only if all
    64 calls are running at once. Calls run fewer at a time would leave the first waiting alone until the barrier's
    timeout breaks it (BrokenBarrierError, every outcome of the round an error)."""
    calls = EnvCalls(64, "environment.factory test:Sleepy", 256)
    barrier = threading.Barrier(64, timeout=30)  # reused: it resets once all 64 have passed

    def meet():
        barrier.wait()
        return "ok"

    for _ in range(3):
        outcomes = calls.run([(meet, 60.0)] * 64)
        assert [(o.value, o.error) for o in outcomes] == [("ok", None)] * 64
    assert not barrier.broken
    calls.close()


def test_calls_that_keep_hanging_stop_the_run_with_one_line():
    calls = EnvCalls(2, "environment.factory my_env.py:Hangs", max_abandoned=2)
    first = calls.run([(lambda: time.sleep(30), 0.05), (lambda: 1 / 0, 1.0)])
    assert first[0].timed_out == "step" and first[1].error == "ZeroDivisionError: division by zero"
    with pytest.raises(EnvironmentHangs, match=r"^environment.factory my_env.py:Hangs: 3 calls are still running"):
        calls.run([(lambda: time.sleep(30), 0.05)] * 2)


def test_a_hung_environment_call_does_not_hold_the_process_at_exit():
    """Daemon threads: a process whose environment call never returns exits when its main code is done."""
    code = ("from grpo_trainer.environments.calls import EnvCalls; import time\n"
            "print(EnvCalls(1, 'x', 5).run([(lambda: time.sleep(600), 0.1)])[0].timed_out)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "step", result.stderr[-2000:]


def test_the_failure_policy_scores_failed_episodes():
    """zero: the failed row 0; none: NaN; skip_group: its whole group NaN (G = 2, two groups)."""
    records = [EpisodeRecord("environment", group="a"), EpisodeRecord("error", group="a"),
               EpisodeRecord("model", group="b"), EpisodeRecord("turns", group="b")]
    expected = {"zero": [1.0, 0.0, 1.0, 1.0], "none": [1.0, math.nan, 1.0, 1.0], "skip_group": [math.nan, math.nan, 1.0, 1.0]}
    for policy, totals in expected.items():
        batch = RewardBatch(per_function=torch.ones(4, 2), total=torch.ones(4), metrics={})
        apply_on_error(batch, records, policy)
        torch.testing.assert_close(batch.total, torch.tensor(totals), equal_nan=True)
        torch.testing.assert_close(batch.per_function[:, 1], torch.tensor(totals), equal_nan=True)


def test_rewards_receive_the_environments_and_the_environment_reward_is_one_more_reward(tiny_model_path):
    from grpo_trainer.data import PromptSet
    from grpo_trainer.rewards import reward_statistics
    from grpo_trainer.task import Task

    tokenizer = _tokenizer()
    seen = {}

    def won(completions, environments, episodes, **kwargs):
        seen.update(environments=environments, episodes=episodes)
        return [1.0 if env is not None and env.won else 0.0 for env in environments]

    engine, _ = _engine(tokenizer, {"r": ["3" + END, "1" + END, "1" + END], "q": ["1" + END, "1" + END, "1" + END]})
    out = engine.generate([_prompt(tokenizer, "r"), _prompt(tokenizer, "q")], 2,
                          episodes=[_spec(tokenizer, "r"), _spec(tokenizer, "q", "step_raises")])
    records = [{"prompt": "Guess [r].", "answer": "3"}, {"prompt": "Guess [q].", "answer": "3"}]
    task = Task(PromptSet(records, ["", ""], [[], []]), [Reward("won", won), environment_reward(2.0)], tokenizer,
                "prompt", "answer", False, on_error="zero")
    scores = task.score([0, 0, 1, 1], out)
    assert seen["environments"][0] is out.environments[0] and seen["episodes"] is out.episodes
    assert scores.per_function.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert scores.total.tolist() == [3.0, 3.0, 0.0, 0.0]
    stats = reward_statistics(task.rewards, scores.per_function)
    assert stats["rewards/environment/mean"] == 0.5
    pickled = __import__("pickle").loads(__import__("pickle").dumps(out))  # objects never cross ranks
    assert pickled.environments is None and pickled.episodes == out.episodes


def test_a_lost_connection_is_a_disconnect_and_an_environment_user_error_stops_the_run(tiny_model_path):
    """A ConnectionError ends its episode as `disconnect` (counted apart from errors); a UserError an environment
    call raises (a remote server that stayed away) is raised from generate, once the batch's calls have ended:
    the run stops with its one line, where an ordinary exception only fails its episode."""
    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {k: ["3" + END] * 2 for k in ("d", "f", "x")})
    out = engine.generate([_prompt(tokenizer, "d"), _prompt(tokenizer, "f")], 2,
                          episodes=[_spec(tokenizer, "d", "step_drops"), _spec(tokenizer, "f")])
    assert [e.ended_by for e in out.episodes] == ["disconnect"] * 2 + ["environment"] * 2
    assert out.episodes[0].error == "respond: ConnectionResetError: peer gone"
    metrics = environment_metrics(episode_counts(out.episodes))
    assert (metrics["environment/disconnects"], metrics["environment/errors"], metrics["environment/frac_failed"]) == (2, 0, 0.5)
    with pytest.raises(EnvironmentServerLost, match=r"^openenv\+ws://127.0.0.1:1 went away and did not come back; stopping$"):
        engine.generate([_prompt(tokenizer, "x"), _prompt(tokenizer, "f")], 2,
                        episodes=[_spec(tokenizer, "x", "server_lost"), _spec(tokenizer, "f")])
    calls = EnvCalls(2, "environment.url openenv+ws://127.0.0.1:1", 4)
    done = []
    with pytest.raises(ConfigError, match="cannot open a session"):  # the lazy session pool's one line
        calls.run([(lambda: (_ for _ in ()).throw(ConfigError("cannot open a session")), 1.0),
                   (lambda: time.sleep(0.2) or done.append(1), 1.0)])
    assert done == [1]  # raised once every call had ended


class Counted(Guess):
    """Guess, counting the episodes alive at once (reset and not yet closed)."""

    lock = threading.Lock()
    alive = most = 0

    def reset(self, seed: int, mode: str = "fair", **row) -> str | None:
        with Counted.lock:
            Counted.alive += 1
            Counted.most = max(Counted.most, Counted.alive)
        self.counted = True
        return super().reset(seed, mode, **row)

    def close(self) -> None:
        if getattr(self, "counted", False):
            with Counted.lock:
                Counted.alive -= 1


class Lockstep:
    """A stand-in for ranks in lockstep where another rank has more to do: it asks for at least `floor` of
    everything (waves, and rounds of turns)."""

    def __init__(self, floor: int):
        self.floor = floor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.clamp(tensor, min=self.floor)


def test_episodes_play_in_waves_of_whole_groups_within_the_capacity_and_give_the_same_results(tiny_model_path):
    """Three groups of 2: with capacity 2 (a remote pool's sessions), one group per wave and never more than 2
    episodes alive; with 4, two waves; under lockstep with a rank that plays 5 waves, empty ones follow. The
    completions, their tokens, messages and records are the same whatever the waves; a group larger than the
    capacity is refused in one line."""
    tokenizer = _tokenizer()
    keys = ["w0", "w1", "w2"]
    scripts = {k: ["1" + END, "2" + END, "3" + END, "4" + END] for k in keys}
    seeds = [11, 12, 13]

    def play(capacity, lockstep=None):
        engine, model = _engine(tokenizer, scripts, factory=Counted)
        engine.environment.capacity = capacity
        model.lockstep = lockstep
        Counted.most = 0
        out = engine.generate([_prompt(tokenizer, k) for k in keys], 2, seeds=seeds,
                              episodes=[_spec(tokenizer, k, seed=3 * i) for i, k in enumerate(keys)])
        first_turns = [c for c in model.calls if c["n"] == 2]
        records = [(e.ended_by, e.env_reward, e.turns, e.group) for e in out.episodes]
        return (out.completion_ids, out.completion_mask, out.sampling_logprobs, out.conversations, out.prompt_ids,
                records), first_turns, Counted.most

    whole, first, most = play(None)
    assert len(first) == 1 and first[0]["seeds"] == seeds and most == 6
    assert {r[0] for r in whole[-1]} == {"environment"} and len({r[1] for r in whole[-1]}) == 2  # won and lost
    for capacity, lockstep, waves in [(2, None, [[11], [12], [13]]), (4, None, [[11, 12], [13]]),
                                      (2, Lockstep(5), [[11], [12], [13], [], []])]:
        got, first, most = play(capacity, lockstep)
        assert got == whole and [c["seeds"] for c in first] == waves and most <= capacity
    engine, _ = _engine(tokenizer, scripts)
    engine.environment.capacity = 1
    with pytest.raises(ConfigError, match=r"a group's 2 episodes must play at once, and this rank can run 1 "):
        engine.generate([_prompt(tokenizer, "w0")], 2, episodes=[_spec(tokenizer, "w0")])


class OneRank:
    """The collectives of a single process."""

    def gather(self, tensor):
        return tensor

    def sum(self, tensor):
        return tensor


def test_environment_counters_are_logged_per_batch_summed_over_ranks():
    from grpo_trainer.collect import episode_stats

    part = Rollout(completion_ids=[[1]], truncated=[False], tool_calls=[0], tool_errors=[0], turns=[1],
                   episodes=[EpisodeRecord("model")], env_counters={"capacity_refusals": 1, "reconnects": 2})
    joined = Rollout.concat([part, part])
    assert joined.env_counters == {"capacity_refusals": 2, "reconnects": 4}
    metrics = episode_stats(OneRank(), joined).metrics
    assert (metrics["environment/capacity_refusals"], metrics["environment/reconnects"]) == (2, 4)
    part.env_counters = {}  # environments that count nothing log nothing of it
    assert "environment/reconnects" not in episode_stats(OneRank(), part).metrics


def test_environment_seeds_are_the_groups_and_fit_31_bits():
    seeds = {environment_seed(s) for s in (0, 1, 2**62, 12345)}
    assert len(seeds) == 4 and all(0 <= s < 2**31 for s in seeds)


class RecordingEngine(SamplesTrainingModel, TakesEpisodes):
    """Records what the rollout queue asks of an engine that needs episodes."""

    needs_episodes = True

    def __init__(self):
        self.asked = []

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        self.asked.append((seeds, episodes))
        n = len(prompt_ids) * num_generations
        return Rollout([[1]] * n, [False] * n)


def test_the_queue_gives_each_group_its_environment_seed_whatever_seed_per_prompt():
    """Rank 1 of 2, its prompts at batch positions 2 and 3: each group's spec carries its row, the environment seed
    of (seed, step, draw, position) and an id naming them; the same with and without rollout.seed_per_prompt."""
    from grpo_trainer.data import PromptSet
    from grpo_trainer.geometry import Geometry
    from grpo_trainer.rollout_queue import QueueSettings, RolloutQueue
    from grpo_trainer.seeds import mix_seed
    from grpo_trainer.task import Task

    records = [{"prompt": f"p{i}"} for i in range(8)]
    task = Task(PromptSet(records, [""] * 8, [[1, i] for i in range(8)]), [], None, "prompt", "answer", False)
    specs = {}
    for per_prompt in (False, True):
        engine = RecordingEngine()
        settings = QueueSettings(max_staleness=0, prompts_per_step=4, max_steps=4, seed=5, seed_per_prompt=per_prompt,
                                 reconnect_timeout=1.0, checkpoints="x")
        queue = RolloutQueue(engine, settings, geometry=Geometry(world=2, rank=1, prompts_per_rank=2, group_size=2),
                             comm=None, task=task, sampler=None, push=None)
        queue._generate([7, 3], step=3, draw=1, version=0)
        seeds, specs[per_prompt] = engine.asked[0]
        assert (seeds is not None) == per_prompt
    for spec, row, position in zip(specs[True], [7, 3], [2, 3]):
        assert spec.record is records[row] and spec.episode_id == f"s3-d1-p{position}"
        assert spec.seed == environment_seed(mix_seed(5, 3, 1, position))
    assert [(s.seed, s.episode_id) for s in specs[True]] == [(s.seed, s.episode_id) for s in specs[False]]


@pytest.mark.parametrize("config, says", [
    ({"environment": {"factory": "a.py:B", "url": "openenv+ws://h:1"}}, "environment: set one of factory, openenv, url, agent or verifiers"),
    ({"environment": {"url": "http://h:1"}}, "environment.url: expected openenv+ws://HOST:PORT"),
    ({"environment": {"url": "openenv+ws://h:1", "kwargs": {"a": 1}}}, "environment.kwargs"),
    ({"environment": {"factory": "a.py:B", "on_error": "ignore"}}, "environment.on_error"),
    ({"environment": {"factory": "a.py:B"}, "data": {"use_chat_template": False}}, "needs data.use_chat_template"),
    ({"rewards": []}, "rewards: at least one reward is needed"),
])
def test_bad_environment_config_is_one_line_naming_the_key(config, says):
    with pytest.raises(ConfigError, match=says.replace("+", r"\+").replace(".", r"\.")):
        config_from_dict(config)
    config_from_dict({"environment": {"factory": "a.py:B"}, "rewards": []})  # an environment may score alone


def test_a_class_whose_tool_method_cannot_be_described_is_refused():
    class Bad:
        def reset(self, **row):
            return None

        def move(self, where):  # no type hints, no docstring
            return where

    with pytest.raises(ConfigError, match=r"cannot describe the method Bad.move to the model"):
        ClassEnvironment(Bad, "environment.factory x.py:Bad", {}, extra_tools=[], tool_timeout=1)


GUESS_ENV = '''
class Guess:
    def reset(self, seed, **row):
        self.secret, self.won, self.n = seed % 3, False, 0
        return None

    def step(self, reply):
        self.n += 1
        self.won = len(reply) % 3 == self.secret
        return ("yes" if self.won else "no"), self.won or self.n >= 2

    def get_reward(self):
        return float(self.won)
'''


def train_guess(tmp_path, out, steps: int, resume: str = "never"):
    from helpers import run_cli, small_run_overrides

    env_file = tmp_path / "guess_env.py"
    env_file.write_text(GUESS_ENV)
    overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
    result = run_cli(["train", "configs/demo_cpu.yaml", *overrides, f"environment.factory={env_file}:Guess",
                      "environment.max_turns=2", "rewards=[]", "rollout.seed_per_prompt=true", "eval.every=2",
                      "eval.num_samples=4", "checkpoint.save_every=1", f"checkpoint.resume={resume}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_trl_style_class_trains_from_the_cli_and_resumes_exactly(tmp_path):
    """`environment.factory` on the tiny model (hf engine), the environment the only reward: 2 steps straight and
    1 + 1 resumed are the same run (environment seeds re-drawn from (step, draw, position)); the environment's
    metrics and reward are logged, evaluation runs the episodes too."""
    from grpo_trainer.metrics import read_metrics
    from helpers import assert_same_run

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_guess(tmp_path, straight, 2)
    train_guess(tmp_path, resumed, 1)
    assert "resumed from" in train_guess(tmp_path, resumed, 2, resume="auto").stderr
    assert_same_run(straight, resumed)
    records = read_metrics(straight)
    assert len(records) == 2 and any(k.startswith("eval/") for k in records[-1])
    for r in records:
        assert 1 <= r["environment/turns_per_episode"] <= 2 and r["environment/errors"] == 0
        assert 0 <= r["rewards/environment/mean"] <= 1 and r["timing/environment"] >= 0
        ends = sum(r[f"environment/frac_ended_by_{e}"] for e in ("environment", "model", "length", "turns"))
        assert abs(ends - 1) < 1e-6


@pytest.mark.slow
def test_two_ranks_each_run_their_own_episodes_and_agree_with_one_process(tmp_path):
    """DDP on two ranks (cpu_ddp.yaml): each rank makes and plays the environments of its own prompts. Environment
    seeds come from (step, draw, position) and, with rollout.seed_per_prompt, so do the samples: step 1 scores
    the very same episodes as one process does, whatever the split over ranks."""
    from grpo_trainer.metrics import read_metrics
    from helpers import ROOT, accelerate_launch, free_port, run_cli, small_run_overrides

    env_file = tmp_path / "guess_env.py"
    env_file.write_text(GUESS_ENV)
    args = [f"environment.factory={env_file}:Guess", "environment.max_turns=2", "rewards=[]",
            "rollout.seed_per_prompt=true", "checkpoint.save_final_model=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(one, 1), *args])
    assert single.returncode == 0, single.stderr[-3000:]
    launcher = accelerate_launch(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml", "--main_process_port", str(free_port()))
    ranks = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(two, 1), *args], launcher=launcher,
                    env={"ACCELERATE_USE_CPU": "1"})
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "world_size=2" in ranks.stderr
    (mine,), (theirs,) = read_metrics(one), read_metrics(two)
    for key in ("rewards/environment/mean", "environment/turns_per_episode", "completions/mean_length",
                "environment/frac_ended_by_environment"):
        assert theirs[key] == pytest.approx(mine[key], abs=1e-6), key


LOST_ENV = '''
from grpo_trainer.environments.openenv_ws import EnvironmentServerLost


class Lost:
    """Plays step 1; from step 2 on, its reset says the server went away for good (as the remote kind's does)."""

    def reset(self, seed, episode_id, **row):
        if not episode_id.startswith("s1-"):
            raise EnvironmentServerLost("openenv+ws://127.0.0.1:1 went away and did not come back within 60 s "
                                        "(environment.reconnect_timeout); stopping")
        return None

    def step(self, reply):
        return "no", True

    def get_reward(self):
        return 0.0
'''


@pytest.mark.slow
def test_an_environment_that_cannot_go_on_stops_the_run_with_one_line_and_the_last_checkpoint_intact(tmp_path):
    from grpo_trainer.checkpoint import verify
    from helpers import run_cli, small_run_overrides

    env_file, out = tmp_path / "lost_env.py", tmp_path / "run"
    env_file.write_text(LOST_ENV)
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, 3), f"environment.factory={env_file}:Lost",
                      "environment.max_turns=2", "rewards=[]", "eval.every=0", "checkpoint.save_every=1"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == ("error: openenv+ws://127.0.0.1:1 went away and did not come back "
                                                      "within 60 s (environment.reconnect_timeout); stopping")
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert latest.name == "step-000001" and verify(latest) is None


# ----------------------------------------------------------------------------- issue 43 part 4: the probe's defects


def test_failed_episodes_are_logged_once_per_kind_naming_the_environment(tiny_model_path, caplog):
    """Defect 3: a failing environment shows in the log (first error of each kind, with how many it ended), not
    only as a reward of 0."""
    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {k: ["3" + END] * 4 for k in "abc"})
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        engine.generate([_prompt(tokenizer, k) for k in "abc"], 2,
                        episodes=[_spec(tokenizer, "a", "reset_raises"), _spec(tokenizer, "b", "step_raises"),
                                  _spec(tokenizer, "c")])
    assert [r.getMessage() for r in caplog.records] == [
        "environment.factory test:Guess: 2 of 6 episodes failed: reset: RuntimeError: no such board",
        "environment.factory test:Guess: 2 of 6 episodes failed: respond: KeyError: 'lost the board'",
    ]


def test_steps_in_which_every_episode_failed_are_unscored_steps_and_stop_the_run(caplog):
    """Defect 3: whatever on_error scores them, a step whose episodes all failed (over all ranks) is warned about
    with its first error and counts toward train.max_consecutive_unscored; one episode that played resets it."""
    from grpo_trainer.collect import episode_stats
    from grpo_trainer.config import load_config
    from grpo_trainer.errors import TrainingError
    from grpo_trainer.update import ScoreChecks, check_scored

    cfg = load_config(None, ["environment.factory=configs/guess_number_env.py:GuessNumber", "rewards=[]",
                             "train.max_consecutive_unscored=1"])
    checks = ScoreChecks.of(cfg, [environment_reward(1.0)])

    def episodes(frac_failed: float):
        """The step's episode statistics, as collect gives them, for 4 episodes of which `frac_failed` failed."""
        played = [EpisodeRecord("error", error="reset: KeyError: 'secret'")] * int(4 * frac_failed)
        played += [EpisodeRecord("environment")] * (4 - len(played))
        rollout = Rollout([[1]] * 4, [False] * 4, tool_calls=[0] * 4, tool_errors=[0] * 4, turns=[1] * 4,
                          episodes=played)
        return episode_stats(OneRank(), rollout)

    def check(frac_failed: float, step: int, in_a_row: int) -> int:
        return check_scored(torch.zeros(4, 1), episodes(frac_failed), step, in_a_row, checks)

    with caplog.at_level("WARNING", logger="grpo_trainer"):
        assert check(1.0, step=1, in_a_row=0) == 1
        assert check(0.5, step=2, in_a_row=1) == 0
        assert check(1.0, step=3, in_a_row=0) == 1
        with pytest.raises(TrainingError) as error:
            check(1.0, step=4, in_a_row=1)
    name = "environment.factory configs/guess_number_env.py:GuessNumber"
    assert (f"step 1: {name} failed every episode: reset: KeyError: 'secret': nothing to learn from this step "
            "(1 in a row; train.max_consecutive_unscored=1)") in caplog.text
    assert str(error.value) == (f"step 4: 2 steps in a row in which {name} failed every episode: reset: KeyError: "
                                "'secret'; stopping (train.max_consecutive_unscored=1)")


class InitRaises:
    def __init__(self, size: int = 3):
        raise RuntimeError("no board\nsecond line")

    def reset(self, **row):
        return None


class CloseRaises:
    def reset(self, **row):
        return None

    def close(self):
        raise OSError("busy")


class NeedsBoard:
    def __init__(self, board: str):
        self.board = board

    def reset(self, **row):
        return None


@pytest.mark.parametrize("factory, kwargs, says", [
    (InitRaises, {}, "environment.factory x.py:E: InitRaises(**environment.kwargs) raised RuntimeError: no board "
                     "(the first object, made at start to read its methods off)"),
    (CloseRaises, {}, "environment.factory x.py:E: CloseRaises.close() raised OSError: busy"),
    (InitRaises, {"sise": 4}, "environment.kwargs (given: sise): InitRaises(size=3) cannot take them: got an "
                              "unexpected keyword argument 'sise'"),
    (NeedsBoard, {}, "environment.kwargs (given: none): NeedsBoard(board) cannot take them: missing a required "
                     "argument: 'board'"),
])
def test_an_environment_that_raises_at_start_or_wrong_kwargs_is_one_line(factory, kwargs, says):
    """Defect 6: __init__ / close() of the first object, and environment.kwargs, are ConfigErrors in one line."""
    with pytest.raises(ConfigError) as error:
        ClassEnvironment(factory, "environment.factory x.py:E", kwargs, extra_tools=[], tool_timeout=1)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_openenv_in_process_checks_its_kwargs_at_start():
    """Defect 6: under environment.openenv a kwargs mistake is refused at start, not every episode failing."""
    from pydantic import BaseModel

    from grpo_trainer.environments.openenv import OpenEnvEnvironment

    class MoveAction(BaseModel):
        to: int

    class Board:
        def __init__(self, size: int):
            self.size = size

        def reset(self, seed=None, episode_id=None):
            return None

        def step(self, action: MoveAction):
            return None

    with pytest.raises(ConfigError, match=r"^environment.kwargs \(given: sise\): Board\(size\) cannot take them"):
        OpenEnvEnvironment(Board, MoveAction, "environment.openenv x.py:Board", {"sise": 3})
    OpenEnvEnvironment(Board, MoveAction, "environment.openenv x.py:Board", {"size": 3})


@pytest.mark.parametrize("value", [np.float32(1.0), np.int64(1), True, np.bool_(True)])
def test_numpy_scalars_and_bools_are_numbers_for_class_environments(tiny_model_path, value):
    """Defect 7: one rule for every real number (the reward functions'): NumPy scalars and bools are rewards, a
    NumPy bool is a `done`; OpenEnv observations read by the same rule."""
    from grpo_trainer.environments.openenv import check_observation

    class NumpyGuess(Guess):
        def step(self, reply: str):
            feedback, done = super().step(reply)
            return np.str_(feedback), np.bool_(done)

        def get_reward(self):
            return value

    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {"n": ["3" + END] * 4}, factory=NumpyGuess)
    out = engine.generate([_prompt(tokenizer, "n")], 2, episodes=[_spec(tokenizer, "n")])
    assert [(e.ended_by, e.env_reward) for e in out.episodes] == [("environment", 1.0)] * 2
    observed = check_observation({"text": "hi"}, np.bool_(True), value, "the server's step")
    assert observed.done is True and observed.reward == 1.0
    with pytest.raises(ProtocolBreach, match="expected true or false"):
        check_observation({}, np.int64(1), None, "the server's step")


def test_each_episode_resets_from_its_own_copy_of_the_row(tiny_model_path):
    """Defect 9: a reset that changes a nested value of its row changes neither its siblings' row nor the dataset."""

    class Mutates:
        def reset(self, seed, board, **row):
            board["moves"].append(seed)
            self.n = len(board["moves"])
            return None

        def get_reward(self):
            return float(self.n)

    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {"m": ["3" + END]}, factory=Mutates)
    record = {"prompt": "Guess [m].", "board": {"moves": []}}
    spec = EpisodeSpec(record, 2, "s1-d0-pm", lambda text: _prompt(tokenizer, "m", text))
    for _epoch in range(2):
        out = engine.generate([_prompt(tokenizer, "m")], 4, episodes=[spec])
        assert [e.env_reward for e in out.episodes] == [1.0] * 4
    assert record == {"prompt": "Guess [m].", "board": {"moves": []}}


class Yields:
    def reset(self, **row):
        return None

    def moves(self) -> str:
        """The moves so far."""
        yield "e4"


class AsyncYields:
    def reset(self, **row):
        return None

    async def moves(self) -> str:
        """The moves so far."""
        yield "e4"


@pytest.mark.parametrize("factory", [Yields, AsyncYields])
def test_a_generator_tool_method_is_refused_at_load(factory, tmp_path):
    """Defect 10: a tool that yields would show the model `<generator object ... at 0x...>`: refused, naming it."""
    with pytest.raises(ConfigError, match=rf"the tool method {factory.__name__}\.moves is a generator"):
        ClassEnvironment(factory, "environment.factory x.py:E", {}, extra_tools=[], tool_timeout=1)
    from grpo_trainer.environments.tools import function_tool

    tool = tmp_path / "gen_tool.py"
    tool.write_text('def moves(n: int) -> str:\n    """Moves.\n\n    Args:\n        n: how many\n    """\n'
                    '    yield "e4"\n')
    with pytest.raises(ConfigError, match=r"^environment.tools.0: '.*gen_tool.py:moves' is a generator"):
        function_tool(f"{tool}:moves", "environment.tools.0")


def test_callable_class_attributes_are_not_tools():
    """Defect 20: only methods defined with def (static and class methods too) are tools; `Helper = dict`, a nested
    class or a callable object is not, and does not make the config fail."""

    class WithHelpers:
        Helper = dict
        Scale = functools.partial(int, base=10)

        class Board:
            pass

        def reset(self, **row):
            return None

        @staticmethod
        def rules() -> str:
            """The rules."""
            return "no"

    env = ClassEnvironment(WithHelpers, "environment.factory x.py:E", {}, extra_tools=[], tool_timeout=1)
    assert [t["function"]["name"] for t in env.tools] == ["rules"]


@pytest.mark.parametrize("limit", [1, 30, 200])
def test_observation_chars_counts_the_cut_note(tiny_model_path, limit):
    """Defect 22: a message cut to environment.observation_chars has at most that many characters, note included."""
    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {"huge": ["3" + END] * 4}, observation_chars=limit, max_turns=2)
    out = engine.generate([_prompt(tokenizer, "huge")], 1, episodes=[_spec(tokenizer, "huge", "huge")])
    shown = out.conversations[0][1]["content"]
    assert len(shown) <= limit and out.episodes[0].observations_cut == 1
    assert shown.endswith("more characters]") == (limit >= 30)


def test_completions_jsonl_shows_the_prompt_with_the_reset_text_and_how_the_episode_ended(tiny_model_path):
    """Defect 18: completions.jsonl (and print_completions, which shows its end) show the prompt the model was
    conditioned on, the reset text included; an episode's record says how it ended and why it failed."""
    from grpo_trainer.collect import episode_stats, training_samples
    from grpo_trainer.report import completion_samples

    tokenizer = _tokenizer()
    engine, _ = _engine(tokenizer, {"r": ["3" + END] * 4, "q": ["3" + END] * 4})
    out = engine.generate([_prompt(tokenizer, "r"), _prompt(tokenizer, "q")], 2,
                          episodes=[_spec(tokenizer, "r"), _spec(tokenizer, "q", "step_raises")])
    # The environment gave every prompt, so the task's prompts are not consulted (task None).
    training = training_samples(None, [0, 1], out, torch.zeros(4), torch.zeros(4, 0))
    assert training.prompts_extended
    texts = [tokenizer.decode(_prompt(tokenizer, "r")), tokenizer.decode(_prompt(tokenizer, "q"))]
    samples = completion_samples(texts, tokenizer, 1, training, episode_stats(OneRank(), out), torch.zeros(4),
                                 torch.zeros(4), 4)
    assert samples[0]["prompt"] == tokenizer.decode(_prompt(tokenizer, "r", " Range 1-4, seed 2."))
    assert "Range 1-4, seed 2." in samples[0]["prompt"] and "Range 1-4" not in texts[0]
    assert (samples[0]["ended_by"], samples[0]["error"]) == ("environment", None)
    assert (samples[2]["ended_by"], samples[2]["error"]) == ("error", "respond: KeyError: 'lost the board'")


FAILING_ENV = '''
class Broken:
    def reset(self, board, **row):
        return None

    def get_reward(self):
        return 1.0
'''


@pytest.mark.parametrize("on_error, mean", [("zero", 0.0), ("none", math.nan)])
def test_eval_counts_environment_failures_apart_from_the_models_scores(tmp_path, caplog, on_error, mean):
    """Defect 8: episodes the environment failed are counted (eval/environment/failed, frac_failed) and warned
    about with their first error, whatever on_error makes of mean@k and pass@k (0, or nan)."""
    from grpo_trainer.config import load_config
    from grpo_trainer.evaluate import evaluate, format_results
    from helpers import ROOT

    env_file = tmp_path / "broken_env.py"
    env_file.write_text(FAILING_ENV)
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", [f"environment.factory={env_file}:Broken", "rewards=[]",
                                                           "environment.max_turns=2", f"environment.on_error={on_error}"])
    with caplog.at_level("WARNING", logger="grpo_trainer"):
        results = evaluate(cfg, k=2, num_prompts=3, progress=False)
    assert results["eval/environment/failed"] == 6 and results["eval/environment/frac_failed"] == 1.0
    assert results["eval/reward/mean@2"] == pytest.approx(mean, nan_ok=True)
    assert (f"eval: 6 of 6 episodes failed (first: reset: TypeError: Broken.reset() missing 1 required positional "
            f"argument: 'board'); mean@k and pass@k count them as ") in caplog.text
    assert "eval/environment/failed: 6\n" in format_results(results)


class StrayServer:
    """A stand-in OpenEnv server on websockets alone (GET /health and /schema, sessions on /ws answering reset, step
    and state, as OpenEnv's protocol does) that, once, sends an extra `state` frame after its first reset's answer."""

    SCHEMA = {
        "action": {"title": "GuessAction", "type": "object", "properties": {"guess": {"type": "integer"}},
                   "required": ["guess"]},
        "observation": {"title": "GuessObservation", "type": "object",
                        "properties": {"feedback": {"type": "string"}, "done": {"type": "boolean"}}},
    }

    def __init__(self):
        import json

        from websockets.sync.server import serve

        self.strays, self.sessions, self.lock = 1, 0, threading.Lock()

        def http(connection, request):
            if request.path in ("/health", "/schema"):
                body = {"status": "healthy"} if request.path == "/health" else self.SCHEMA
                return connection.respond(200, json.dumps(body))
            return None

        def observation(feedback: str, done: bool) -> str:
            return json.dumps({"type": "observation", "data": {"observation": {"feedback": feedback}, "done": done,
                                                               "reward": 1.0 if done else 0.0}})

        def session(ws):
            with self.lock:
                self.sessions += 1
            steps = 0
            for frame in ws:
                kind = json.loads(frame)["type"]
                if kind == "state":
                    ws.send(json.dumps({"type": "state", "data": {"step_count": steps}}))
                elif kind == "reset":
                    steps = 0
                    ws.send(observation("reset", False))
                    with self.lock:
                        stray, self.strays = self.strays > 0, self.strays - 1
                    if stray:
                        ws.send(json.dumps({"type": "state", "data": {"step_count": steps}}))
                elif kind == "step":
                    steps += 1
                    ws.send(observation(f"step {steps}", steps >= 2))
                else:
                    return

        self.server = serve(session, "127.0.0.1", 0, process_request=http)
        self.url = f"openenv+ws://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_stray_frame_closes_its_session_and_never_answers_a_later_request():
    """Defect 5: one extra frame from the server fails the episode it came in (a protocol breach), and its session
    is closed, not lent again: every later episode reads its own answers."""
    from grpo_trainer.environments.openenv_ws import OpenEnvRemote

    server = StrayServer()
    remote = OpenEnvRemote(server.url, sessions=1, step_timeout=2.0, reconnect_timeout=5.0, max_message_mb=1)
    spec = EpisodeSpec({"prompt": "Guess."}, 3, "s1-d0-p0", lambda text: [])
    try:
        first = remote.episode()
        assert first.reset(spec, 0) == "reset"
        with pytest.raises(ProtocolBreach, match=r"(sent a frame nobody asked for before step|answered step with a 'state' "
                                             r"message).*the session is closed$"):
            first.respond('{"guess": 1}', [])
        first.close()
        for j in range(1, 4):
            episode = remote.episode()
            assert episode.reset(spec, j) == "reset"
            replies = [episode.respond('{"guess": 1}', []) for _ in range(2)]
            assert [(r.messages[0]["content"], r.done) for r in replies] == [("step 1", False), ("step 2", True)]
            assert episode.snapshot().state == {"step_count": 2}
            episode.close()
        assert server.sessions == 2  # the stray's session closed, one new one, reused
    finally:
        remote.close()
        server.server.shutdown()
