"""environment.agent and the producer seam (grpo_trainer/agents/engine.py, solve.py, producer.py): agent programs
trained token-in/token-out, over a real aiohttp endpoint, with the real `openai` client, on the tiny model's hf
engine.

Each test attacks one property: the OpenAI-SDK example trains from the CLI and a resumed run is the same run;
the trained row is what was sampled (sampler log-probs equal the trainer's recomputed ones, what came between turns
masked) and an episode with several branches trains on its last; every way an agent can fail ends its episode
only, and the agent's own time, not its requests', is what the timeout counts; the config is checked before any
model loads.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import torch

from grpo_trainer.agents.engine import AgentEngine, AgentEpisodeRecord
from grpo_trainer.agents.producer import Played, PlayerEnvironment
from grpo_trainer.agents.solve import SolvePlayer
from grpo_trainer.collect import training_samples
from grpo_trainer.config import ModelConfig
from grpo_trainer.environments import EpisodeSpec
from grpo_trainer.environments.protocol import ENDED_BY_ENVIRONMENT, ENDED_BY_LENGTH, FAILED_ERROR, FAILED_TIMEOUT
from grpo_trainer.errors import ConfigError
from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer, make_sequence_batch
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.hf import HFEngine

BUDGET = 24


@pytest.fixture(scope="module")
def policy(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=BUDGET, temperature=0.9)
    return tokenizer, lm, HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id)


def agent_engine(policy, player, timeout: float = 30.0) -> AgentEngine:
    tokenizer, _, engine = policy
    return AgentEngine(
        engine,
        PlayerEnvironment(player),
        tokenizer,
        seed=5,
        eos_token_ids=[tokenizer.eos_token_id],
        max_completion_length=BUDGET,
        max_model_len=None,
        episode_timeout=timeout,
        concurrency=16,
    )


def specs(rows: list[dict], tokenizer) -> tuple[list[list[int]], list[EpisodeSpec]]:
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    return prompts, [EpisodeSpec(r, 1000 + i, f"s1-d0-p{i}", lambda text: []) for i, r in enumerate(rows)]


def play(engine: AgentEngine, rows: list[dict], g: int = 1):
    prompts, episode_specs = specs(rows, engine.tokenizer)
    return engine.generate(prompts, g, episodes=episode_specs)


def chat(handle, messages, max_tokens=8, key=None):
    """(status, body) of a plain-HTTP chat request."""
    body = json.dumps({"model": handle.model, "messages": messages, "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key or handle.api_key}"}
    request = urllib.request.Request(f"{handle.base_url}/chat/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# ------------------------------------------------------------------------------------------ trained as sampled


class TwoTurns:
    """Asks, then asks again after its own reply (the endpoint splices the sampled ids back in): one branch. With
    `fork`, it starts a second conversation first: two branches, the last trained."""

    name = "test two turns"
    stop_conditions = ("done",)

    def __init__(self, fork: bool = False):
        self.fork = fork

    async def play(self, row, episode, seed) -> Played:
        messages = [{"role": "user", "content": row["prompt"]}]
        if self.fork:
            status, _ = await asyncio.to_thread(chat, episode, [{"role": "user", "content": "hi"}], 4)
            assert status == 200
        status, first = await asyncio.to_thread(chat, episode, messages)
        assert status == 200, first
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And 1+1?"}]
        status, second = await asyncio.to_thread(chat, episode, messages)
        assert status == 200, second
        return Played(reward=1.0, stop_condition="done")


@pytest.mark.slow
def test_the_row_is_what_was_sampled_and_a_forked_episode_trains_every_branch(policy):
    """Two chat turns become one row: the first prompt, then the sampled tokens (mask 1, the sampler's log-probs,
    equal to the trainer's recomputed ones to float rounding), with the template's tokens and the agent's second
    message between them masked (0, log-prob 0). An episode that began with a second conversation keeps G
    completions (its last branch each) and carries its earlier branch along, which collect makes a row of its own."""
    tokenizer, lm, _ = policy
    engine = agent_engine(policy, TwoTurns())
    try:
        rows = [{"prompt": "What is 2+3?"}, {"prompt": "What is 4+4?"}]
        rollout = play(engine, rows, g=2)
        assert len(rollout.completion_ids) == 4
        for j in range(4):
            record = rollout.episodes[j]
            assert isinstance(record, AgentEpisodeRecord) and record.ended_by in (ENDED_BY_ENVIRONMENT, ENDED_BY_LENGTH)
            assert record.turns == 2 and record.branches == 1 and record.stop_condition == "done"
            mask, logprobs = rollout.completion_mask[j], rollout.sampling_logprobs[j]
            assert 0 in mask and mask[0] == 1  # sampled, then what came between turns, then sampled again
            assert all(lp == 0.0 for m, lp in zip(mask, logprobs) if m == 0)
            assert rollout.conversations[j][-1]["role"] == "assistant" and len(rollout.conversations[j]) == 4
            batch = make_sequence_batch([rollout.prompt_ids[j]], [rollout.completion_ids[j]], tokenizer.pad_token_id)
            with torch.no_grad():
                trainer, _ = TokenLogprobs(lm, temperature=0.9)(**batch.tensors())
            sampled = torch.tensor(mask, dtype=torch.bool)
            torch.testing.assert_close(
                torch.tensor(logprobs)[sampled], trainer[0, : len(mask)][sampled], atol=2e-5, rtol=2e-5
            )
        assert rollout.env_counters["agent/branch_rows"] == 0 and rollout.branches == [[]] * 4
        stops = {k: v for k, v in rollout.env_counters.items() if k.startswith("agent/stop/")}
        assert stops == {"agent/stop/done": 4.0, "agent/stop/none": 0.0, "agent/stop/other": 0.0}
    finally:
        engine.close()
    engine = agent_engine(policy, TwoTurns(fork=True))
    try:
        rollout = play(engine, [{"prompt": "What is 2+3?"}], g=2)
        assert len(rollout.completion_ids) == 2
        assert [r.branches for r in rollout.episodes] == [2, 2]
        assert rollout.env_counters["agent/branch_rows"] == 2
        assert all(r.turns == 3 for r in rollout.episodes)
        # the completion is the conversation about the row; the "hi" one goes with it, sampled tokens and all
        assert all("2+3" in tokenizer.decode(p) for p in rollout.prompt_ids)
        assert [len(b) for b in rollout.branches] == [1, 1]
        for j, (first,) in enumerate(rollout.branches):
            assert "hi" in tokenizer.decode(first.prompt_ids) and "2+3" not in tokenizer.decode(first.prompt_ids)
            assert sum(first.completion_mask) > 0 and len(first.logprobs) == len(first.completion_ids)
            record = rollout.episodes[j]
            assert record.completion_tokens == sum(first.completion_mask) + sum(rollout.completion_mask[j])
        # collect: 2 completions, then the 2 earlier branches as rows of their own, each with its episode's advantage
        samples = training_samples(None, [0], rollout, torch.tensor([1.0, 0.0]), torch.zeros(2, 1))
        assert samples.completions == 2 and samples.branch_of == [0, 1] and len(samples.completion_ids) == 4
        assert samples.completion_ids[2:] == [b.completion_ids for (b,) in rollout.branches]
        assert samples.sampler_logprobs[2:] == [b.logprobs for (b,) in rollout.branches]
        assert samples.per_row(torch.tensor([0.5, -0.5])).tolist() == [0.5, -0.5, 0.5, -0.5]
    finally:
        engine.close()


class AsksIfTold:
    """Returns at once without a request, unless its row says `ask`: then one chat request."""

    name = "test asks if told"

    async def play(self, row, episode, seed) -> Played:
        if row.get("ask"):
            status, body = await asyncio.to_thread(chat, episode, [{"role": "user", "content": row["prompt"]}], 4)
            assert status == 200, body
        return Played(reward=1.0)


@pytest.mark.slow
def test_rounds_hand_each_place_on_once_when_episodes_end_together(policy):
    """rounds (rollout.seed_per_prompt), 8 episodes, 3 places: the first 6 return at once without a request, so
    slots 3-5 end together with only slots 6 and 7 waiting; then 6 and 7 ask. Each ending episode promises its place
    to at most one waiting slot: three promises for two slots would leave the next round waiting for a third that
    never starts, and cut it after round_timeout_s (30 s). The round of 6 and 7 is taken whole, at once."""
    tokenizer, _, inner = policy
    agents = AgentEngine(inner, PlayerEnvironment(AsksIfTold()), tokenizer, seed=5, eos_token_ids=[tokenizer.eos_token_id],
                         max_completion_length=BUDGET, max_model_len=None, episode_timeout=60.0, concurrency=3,
                         rounds=True)
    try:
        rollout = play(agents, [{"prompt": f"What is {i}+{i}?", "ask": i == 3} for i in range(4)], g=2)
        assert agents.endpoint.counters().get("agent/rounds_cut", 0) == 0
        assert agents.endpoint.counters()["agent/batches"] == 1  # one round: both askers' requests
        assert [e.requests for e in rollout.episodes] == [0] * 6 + [1, 1]
    finally:
        agents.close()


# ------------------------------------------------------------------------------------------ failure


AGENTS = textwrap.dedent(
    """
    import asyncio, http.client, json, os, sys, threading, time, urllib.parse, urllib.request

    def ask(base_url, key, max_tokens=4, content="What is 1+2?"):
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(base_url + "/chat/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    async def solve(row, *, base_url, api_key, model, seed):
        kind = row["kind"]
        if kind == "good":
            from openai import AsyncOpenAI
            async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
                await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
            return {"correct": 1.0, "short": 0.5}
        if kind == "raise":
            raise ValueError("unlucky")
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "exit":
            sys.exit(3)
        if kind == "os_exit":
            os._exit(4)
        if kind == "bad_auth":
            from openai import AsyncOpenAI
            async with AsyncOpenAI(base_url=base_url, api_key="not-the-key", max_retries=0) as client:
                await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        if kind == "malformed":
            request = urllib.request.Request(base_url + "/chat/completions", data=b"{not json", method="POST",
                                             headers={"Authorization": "Bearer " + api_key})
            urllib.request.urlopen(request, timeout=60)
        if kind == "flood":
            # 40 at once, more than an episode may have in flight: each thread connects first and all send together
            # (threads that connected and sent one by one were each answered before the next on a loaded machine)
            url = urllib.parse.urlsplit(base_url)
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            headers = {"Content-Type": "application/json", "Authorization": "Bearer " + api_key}
            together, statuses = threading.Barrier(40), []

            def one():
                connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
                connection.connect()
                together.wait()
                connection.request("POST", url.path + "/chat/completions", body, headers)
                statuses.append(connection.getresponse().status)
                connection.close()

            threads = [threading.Thread(target=one) for _ in range(40)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            raise RuntimeError(f"{sum(status != 200 for status in statuses)} of 40 refused")
        if kind == "budget":
            while True:  # asks until the endpoint refuses (400 budget_exhausted), which raises
                ask(base_url, api_key, 1000)
        if kind == "not_a_number":
            return "high"
        if kind == "sync_hang":
            return None  # handled by the sync solve below
        raise AssertionError(kind)

    def sync_solve(row, *, base_url, api_key, model, seed):
        if row["kind"] == "sync_hang":
            time.sleep(3600)
        if row["kind"] == "sync_exit":
            os._exit(5)
        ask(base_url, api_key, 2)
        return 0.25
    """
)


def user_agents(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    from grpo_trainer.agents.solve import resolve_solve

    return path, resolve_solve(f"{path}:solve"), resolve_solve(f"{path}:sync_solve")


@pytest.mark.slow
def test_every_way_an_agent_fails_ends_only_its_episode(policy, tmp_path, caplog):
    """Raising, hanging past environment.episode_timeout, sys.exit, os._exit (async and sync), a flood of requests,
    a wrong key, a malformed body, asking past the budget, a reward that is not a number: each ends its own episode
    (failed, with its reason), counted and logged in one line per kind; the good episodes beside them are scored;
    and the engine plays the next batch as if nothing happened."""
    path, solve, sync_solve = user_agents(tmp_path)
    kinds = ["good", "raise", "hang", "exit", "os_exit", "bad_auth", "malformed", "flood", "budget", "not_a_number"]
    player = SolvePlayer(solve, f"{path}:solve", {"correct": 1.0, "short": 0.1})
    # 4 s: a good episode's own time (its HTTP client, its Python) stays far below it on two loaded cores, once the
    # `openai` package is loaded: its first import took over 4 s of the good agent's own time in a loaded full suite
    import openai  # noqa: F401

    engine = agent_engine(policy, player, timeout=4.0)
    try:
        tick = time.perf_counter()
        with caplog.at_level("WARNING", logger="grpo_trainer"):
            rollout = play(engine, [{"kind": k, "prompt": k} for k in kinds])
        assert time.perf_counter() - tick < 120  # a bound on hanging, not a speed: the slowest failure ends at its 4 s timeout
        by_kind = dict(zip(kinds, rollout.episodes))
        assert by_kind["good"].ended_by == ENDED_BY_ENVIRONMENT and by_kind["good"].rewards == {
            "correct": 1.0,
            "short": 0.5,
        }
        assert by_kind["hang"].ended_by == FAILED_TIMEOUT
        errors = {k: by_kind[k].error for k in kinds if k not in ("good", "hang")}
        assert all(by_kind[k].ended_by == FAILED_ERROR for k in errors), errors
        assert "ValueError: unlucky" in errors["raise"] and "SystemExit: 3" in errors["exit"]
        assert "os._exit(4)" in errors["os_exit"] and "AuthenticationError" in errors["bad_auth"]
        assert "HTTPError" in errors["malformed"] and "refused" in errors["flood"]
        assert "HTTPError" in errors["budget"] and by_kind["budget"].refused.get("budget_exhausted") == 1
        assert "'high' is not a dict of the rewards environment.reward_weights names" in errors["not_a_number"]
        assert by_kind["flood"].refused.get("too_many_requests", 0) > 0
        # each request a new conversation: as many branches as turns, the budget spent over them, every one trained
        budget, at = by_kind["budget"], kinds.index("budget")
        assert budget.completion_tokens == BUDGET and budget.branches == budget.turns >= 2
        earlier = rollout.branches[at]
        assert len(earlier) == budget.branches - 1
        assert sum(rollout.completion_mask[at]) + sum(sum(b.completion_mask) for b in earlier) == BUDGET
        assert rollout.env_counters["agent/refused"] >= 3  # the wrong key is refused before it names an episode
        assert any("of 10 episodes failed" in r.getMessage() for r in caplog.records)
        # the engine goes on: the next batch plays
        again = play(engine, [{"kind": "good", "prompt": "x"}], g=2)
        assert [e.ended_by for e in again.episodes] == [ENDED_BY_ENVIRONMENT] * 2
    finally:
        engine.close()
    sync_player = SolvePlayer(sync_solve, f"{path}:sync_solve")
    engine = agent_engine(policy, sync_player, timeout=4.0)
    try:
        rollout = play(engine, [{"kind": k, "prompt": k} for k in ("sync_hang", "sync_exit", "ok")])
        hang, exit_, ok = rollout.episodes
        assert hang.ended_by == FAILED_TIMEOUT and exit_.ended_by == FAILED_ERROR and "os._exit(5)" in exit_.error
        assert ok.ended_by == ENDED_BY_ENVIRONMENT and ok.env_reward == 0.25 and ok.turns == 1
    finally:
        engine.close()


class Blocker:
    """Blocks the event loop it plays on (sync sleep in async code), or answers at once."""

    name = "test blocker"

    async def play(self, row, episode, seed) -> Played:
        if row["prompt"] == "block":
            time.sleep(8)
        return Played(reward=1.0)


@pytest.mark.slow
def test_an_agent_that_blocks_the_event_loop_fails_its_batch_and_the_next_batch_plays(policy, caplog):
    engine = agent_engine(policy, Blocker(), timeout=0.5)
    engine.loop_grace = 0.5
    try:
        tick = time.perf_counter()
        with caplog.at_level("WARNING", logger="grpo_trainer"):
            blocked = play(engine, [{"prompt": "block"}])
        assert time.perf_counter() - tick < 6  # given up on (after ~1 s) long before the 8 s sleep ends
        assert [e.ended_by for e in blocked.episodes] == [FAILED_TIMEOUT]
        assert any("event loop has been blocked" in r.getMessage() for r in caplog.records)
        assert [e.ended_by for e in play(engine, [{"prompt": "fine"}], g=2).episodes] == [ENDED_BY_ENVIRONMENT] * 2
    finally:
        engine.close()


class SlowSampler:
    """The endpoint's sampler, each batch 1 s slower: time an episode spends waiting for its answers."""

    def __init__(self, inner):
        self.inner, self.max_model_len, self.max_batch = inner, inner.max_model_len, inner.max_batch

    def sample(self, requests):
        time.sleep(1.0)
        return self.inner.sample(requests)


class Patient:
    """Three requests, one after the other (3 s in the sampler), and 0.2 s of its own; or its own 1.5 s."""

    name = "test patient"

    async def play(self, row, episode, seed) -> Played:
        if row["prompt"] == "slow":
            await asyncio.sleep(1.5)
            return Played(reward=0.0)
        for _ in range(3):
            assert (await asyncio.to_thread(chat, episode, [{"role": "user", "content": "hi"}], 2))[0] == 200
        await asyncio.sleep(0.2)
        return Played(reward=1.0)


@pytest.mark.slow
def test_the_timeout_counts_the_agents_own_time_not_its_requests(policy):
    engine = agent_engine(policy, Patient(), timeout=1.0)
    engine._sampler = lambda: SlowSampler(AgentEngine._sampler(engine))  # type: ignore[method-assign]
    try:
        waits, slow = play(engine, [{"prompt": "waits"}, {"prompt": "slow"}]).episodes
        assert waits.ended_by == ENDED_BY_ENVIRONMENT and waits.sampler_seconds >= 3.0
        assert slow.ended_by == FAILED_TIMEOUT
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------ config


def test_environment_agent_is_checked_before_the_model_loads(tmp_path):
    """A missing file, a missing function, a function that cannot take solve's arguments: one ConfigError naming
    environment.agent; a second environment kind is refused when the config loads (max_staleness >= 1 is not:
    an agent's batches are saved with a checkpoint, tests/test_vllm_server.py)."""
    from grpo_trainer.config import load_config
    from grpo_trainer.environments.checks import check_environment

    (tmp_path / "a.py").write_text(
        "def solve(row):\n    return 1.0\n\nasync def fine(row, *, base_url, api_key, model, seed):\n    return 1.0\n"
    )
    for spec, message in [
        (f"{tmp_path}/missing.py:solve", "agent file not found"),
        (f"{tmp_path}/a.py:nope", "has no function 'nope'"),
        (f"{tmp_path}/a.py:solve", "cannot be called as solve(row, *, base_url, api_key, model, seed)"),
    ]:
        cfg = load_config("configs/agent_cpu.yaml", [f"environment.agent={spec}"])
        with pytest.raises(ConfigError, match="environment.agent") as error:
            check_environment(cfg, contact_server=False)
        assert message in str(error.value)
    check_environment(
        load_config("configs/agent_cpu.yaml", [f"environment.agent={tmp_path}/a.py:fine"]), contact_server=False
    )
    assert load_config("configs/agent_cpu.yaml", ["rollout.max_staleness=1", "rollout.engine=vllm_server"])
    with pytest.raises(Exception, match="set one of factory, openenv, url, agent or verifiers"):
        load_config("configs/agent_cpu.yaml", ["environment.factory=configs/guess_number_env.py:GuessNumber"])
    with pytest.raises(Exception, match="environment.reward_weights"):
        load_config("configs/demo_cpu.yaml", ["environment.reward_weights={a: 1.0}"])


# ------------------------------------------------------------------------------------------ the example, trained


def train_agent(out, steps: int, resume: str = "never", launcher=None):
    from helpers import launch_failure, run_cli, small_run_overrides

    overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
    result = run_cli(
        ["train", "configs/agent_cpu.yaml", *overrides, "checkpoint.save_every=1", f"checkpoint.resume={resume}"],
        launcher=launcher,
        env={"ACCELERATE_USE_CPU": "1"} if launcher else None,
    )
    assert result.returncode == 0, launch_failure(result)
    return result


# Metrics two DDP ranks must log as one process does at the first step (same weights, every request seeded from
# (run seed, group, slot, turn), never the rank): the episodes, what was sampled, and the rewards.
SAME_ON_TWO_RANKS = (
    "rewards/environment/mean",
    "environment/agent/episodes",
    "environment/agent/requests",
    "environment/agent/completion_tokens",
    "completions/mean_length",
    "environment/errors",
)


@pytest.mark.slow
def test_the_openai_sdk_example_trains_resumes_exactly_and_two_ranks_agree_with_one(tmp_path):
    """configs/agent_cpu.yaml (configs/agents/openai_agent.py: the `openai` SDK against the run's endpoint) from the
    CLI: 2 steps straight and 1 + 1 resumed give bit-identical weights and metrics (every request seeded from
    (run seed, group, slot, turn)); the agent's reward is the `environment` reward; what was trained is what was
    sampled (the sampler/trainer log-prob gap is float rounding). On two DDP ranks (cpu_ddp.yaml), each rank plays
    its own prompts' episodes against its own endpoint (a loopback port of its process: the other rank's episodes
    cannot reach it), so all 16 requests served with no error means both endpoints served; step 1 logs what one
    process logs, and after the DDP update each rank's endpoint still samples what its trainer scores."""
    from grpo_trainer.metrics import read_metrics
    from helpers import ROOT, accelerate_launch, assert_same_run, free_port

    straight, resumed, ranks = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ranks"
    train_agent(straight, 2)
    train_agent(resumed, 1)
    assert "resumed from" in train_agent(resumed, 2, resume="auto").stderr
    assert_same_run(straight, resumed)
    records = read_metrics(straight)
    assert len(records) == 2
    for r in records:
        assert r["environment/agent/episodes"] == 16 and r["environment/agent/requests"] == 16
        assert r["environment/errors"] == 0 and r["environment/turns_per_episode"] == 1
        assert 0 <= r["rewards/environment/mean"] <= 1
        assert r["sampling/logp_diff_max"] < 1e-4
    launcher = accelerate_launch(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml", "--main_process_port", str(free_port()))
    assert "world_size=2" in train_agent(ranks, 2, launcher=launcher).stderr
    two = read_metrics(ranks)
    assert [r["step"] for r in two] == [1, 2]
    for key in SAME_ON_TWO_RANKS:
        assert two[0][key] == pytest.approx(records[0][key], abs=1e-6), key
    for r in two:
        assert r["environment/agent/requests"] == 16 and r["environment/errors"] == 0
        assert r["sampling/logp_diff_max"] < 1e-4


FORKING_AGENT = textwrap.dedent(
    """
    from openai import AsyncOpenAI

    async def solve(row, *, base_url, api_key, model, seed):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            warmup = await client.chat.completions.create(  # a conversation of its own: a second branch
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=seed
            )
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=6, seed=seed
            )
        text = (warmup.choices[0].message.content or "") + (reply.choices[0].message.content or "")
        return float(sum(map(ord, text)) % 2)  # the random model's replies vary: so do the rewards
    """
)


@pytest.mark.slow
def test_an_episode_that_branched_trains_every_branch_from_the_cli(tmp_path):
    """An agent that opens two conversations per episode, 2 steps from the CLI: each episode's earlier branch is a
    row of its own (environment/agent/branch_rows = 16 a step), trained with its episode's advantage (the loss is over
    24 rows: completions/trained_fraction counts them), and resuming is still exact (1 + 1 = 2 straight)."""
    from grpo_trainer.metrics import read_metrics
    from helpers import assert_same_run, run_cli, small_run_overrides

    agent = tmp_path / "forking.py"
    agent.write_text(FORKING_AGENT)

    def train(out, steps, resume="never"):
        overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
        result = run_cli(["train", "configs/agent_cpu.yaml", *overrides, f"environment.agent={agent}:solve",
                          "checkpoint.save_every=1", f"checkpoint.resume={resume}"])
        assert result.returncode == 0, result.stderr[-4000:]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, 2)
    train(resumed, 1)
    train(resumed, 2, resume="auto")
    assert_same_run(straight, resumed)
    for r in read_metrics(straight):
        assert r["environment/agent/episodes"] == 16 and r["environment/agent/requests"] == 32
        assert r["environment/agent/branches"] == 32 and r["environment/agent/branch_rows"] == 16
        assert r["environment/errors"] == 0 and math.isfinite(r["loss"])
        assert 0 < r["completions/trained_fraction"] <= 1
        assert r["sampling/logp_diff_max"] < 1e-4  # the branch rows' sampler log-probs are the trainer's too


def test_stop_conditions_are_counted_per_declared_name_the_same_names_every_batch():
    """A player's declared `stop_conditions` are logged per name (environment/agent/stop/<name>) at every batch, 0
    where none stopped so, with `none` (no stop condition, or failed first) and `other` (undeclared): every rank
    sums the same names. A player that declares none gets no stop counts."""
    from grpo_trainer.rollout import Rollout

    class Quiet:
        name = "test quiet"

        async def play(self, row, episode, seed) -> Played:
            return Played(reward=None)

    class Engine:
        def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
            return Rollout([], [])

        def close(self):
            pass

    class Declares(Quiet):
        stop_conditions = ("won", "gave_up")

    def counters(player, stops):
        engine = AgentEngine(Engine(), PlayerEnvironment(player), None, seed=0, eos_token_ids=[2],
                             max_completion_length=8, max_model_len=64, episode_timeout=5.0, concurrency=2)
        try:
            records = [AgentEpisodeRecord(ENDED_BY_ENVIRONMENT, stop_condition=s) for s in stops]
            return {k: v for k, v in engine._counters(records).items() if k.startswith("agent/stop/")}
        finally:
            engine.close()

    assert counters(Declares(), ["won", "won", None, "timeout", "won"]) == {
        "agent/stop/won": 3.0, "agent/stop/gave_up": 0.0, "agent/stop/none": 1.0, "agent/stop/other": 1.0}
    assert set(counters(Declares(), [])) == {f"agent/stop/{n}" for n in ("won", "gave_up", "none", "other")}
    assert counters(Quiet(), ["won"]) == {}


def test_any_engine_that_reports_sampler_logprobs_serves_the_endpoint():
    """EngineTokenSampler (the vLLM engines' way in): the requests of a batch with one max_tokens go in one
    `generate(prompts, 1, seeds=..., max_tokens=...)`, each completion is cut after its own stop token with its
    log-probs, and the results come back in the requests' order; an engine without sampler log-probs is refused."""
    from grpo_trainer.agents.sampler import EngineTokenSampler, TokenRequest
    from grpo_trainer.rollout import Rollout

    calls = []

    class Engine:
        logprobs = True

        def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
            calls.append((len(prompt_ids), num_generations, list(seeds), max_tokens))
            ids = [[s % 10 + k for k in range(max_tokens)] for s in seeds]  # seed-determined tokens
            logprobs = [[-0.5 - k for k in range(max_tokens)] for _ in seeds] if self.logprobs else None
            return Rollout(ids, [True] * len(ids), sampling_logprobs=logprobs)

    sampler = EngineTokenSampler(Engine(), eos_token_ids=[2], max_model_len=64)
    requests = [TokenRequest([1], 4, 10), TokenRequest([1], 3, 21), TokenRequest([1], 4, 33, stop_token_ids=(5,))]
    out = sampler.sample(requests)
    assert sorted(calls) == [(1, 1, [21], 3), (2, 1, [10, 33], 4)]
    assert (out[0].completion_ids, out[0].finish_reason) == ([0, 1, 2], "stop")  # EOS 2 ends it
    assert (out[1].completion_ids, out[1].finish_reason) == ([1, 2], "stop")
    assert (out[2].completion_ids, out[2].logprobs, out[2].finish_reason) == ([3, 4, 5], [-0.5, -1.5, -2.5], "stop")
    assert sampler.sample([TokenRequest([1], 2, 7)])[0].finish_reason == "length"
    no_logprobs = Engine()
    no_logprobs.logprobs = False
    with pytest.raises(RuntimeError, match="reports no sampler log-probs"):
        EngineTokenSampler(no_logprobs, [2], 64).sample(requests)


def test_named_rewards_and_the_episodes_messages_reach_the_scoring(tmp_path, tiny_model_path):
    """With environment.reward_weights, each name is a reward `environment/<name>` with its weight, read from the
    episodes' records (None where an episode gave none); a reward function of `rewards:` gets the episode's messages
    as its completion; a failed episode is scored by environment.on_error."""
    from grpo_trainer.config import load_config
    from grpo_trainer.environments import build_environment
    from grpo_trainer.rollout import Rollout
    from grpo_trainer.task import load_task

    (tmp_path / "agent.py").write_text("async def solve(row, *, base_url, api_key, model, seed):\n    return None\n")
    (tmp_path / "reward.py").write_text(
        "def replies(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    cfg = load_config("configs/agent_cpu.yaml", [
        f"environment.agent={tmp_path}/agent.py:solve", "environment.reward_weights={correct: 1.0, short: 0.5}",
        f"rewards=[{{name: {tmp_path}/reward.py:replies, weight: 0.0}}]",
    ])
    environment = build_environment(cfg)
    task = load_task(cfg.data, cfg.rewards, load_tokenizer(ModelConfig()), None, environment=environment,
                     environment_config=cfg.environment)
    assert [r.name for r in task.rewards] == ["replies", "environment/correct", "environment/short"]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    records = [
        AgentEpisodeRecord(ENDED_BY_ENVIRONMENT, rewards={"correct": 1.0, "short": 0.2}),
        AgentEpisodeRecord(ENDED_BY_ENVIRONMENT, rewards={"correct": 0.0}),
        AgentEpisodeRecord(FAILED_ERROR, error="the agent: ValueError: x"),
    ]
    rollout = Rollout([[5], [5], [5]], [False] * 3, conversations=[messages, messages[1:], messages],
                      tool_calls=[0] * 3, episodes=records)
    scored = task.score([0, 0, 0], rollout)
    expected = torch.tensor([[2.0, 1.0, 0.2], [1.0, 0.0, float("nan")]])
    torch.testing.assert_close(scored.per_function[:2], expected, equal_nan=True)
    torch.testing.assert_close(scored.total[:2], torch.tensor([1.1, 0.0]))  # weights 0, 1, 0.5; None adds nothing
    assert scored.per_function[2].tolist() == [0.0, 0.0, 0.0] and scored.total[2] == 0.0  # on_error: zero
