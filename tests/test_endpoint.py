"""The token endpoint (grpo_trainer/agents): real HTTP on loopback, the tiny model on the hf engine.

Each test attacks one property: only the run's keys are served; the token route's shapes; the sampler log-probs
equal the trainer's recomputed ones; batching and concurrency change no token; chat turns reuse the sampled ids,
and a conversation the template re-renders differently is counted and branched; bad requests are refused while
the server goes on; the server closes.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch

from grpo_trainer.agents.endpoint import EndpointLimits, TokenEndpoint
from grpo_trainer.agents.sampler import HFTokenSampler
from grpo_trainer.config import ModelConfig
from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer, make_sequence_batch
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.hf import HFEngine

pytestmark = pytest.mark.slow  # loads the tiny model, starts servers

LIMITS = EndpointLimits(max_body_bytes=20_000, max_request_tokens=256, max_in_flight_per_episode=4, batch_window_s=2.0)


@pytest.fixture(scope="module")
def policy(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    lm = load_causal_lm(ModelConfig())
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=16, temperature=0.9)
    engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, lm, engine, HFTokenSampler(engine, max_batch=8)


@pytest.fixture(scope="module")
def endpoint(policy):
    tokenizer, _, _, sampler = policy
    with TokenEndpoint(sampler, tokenizer, seed=7, limits=LIMITS) as server:
        yield server


def prompt(tokenizer, question: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def post(url: str, body, key: str | None, session: str | None = None, raw: bytes | None = None):
    """(status, JSON body) of a POST."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if session is not None:
        headers["X-Session-ID"] = session
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def generate(endpoint, key, token_ids, session=None, **params):
    body = {"model": "policy", "token_ids": token_ids, "sampling_params": {"logprobs": 1, **params}}
    return post(f"{endpoint.url}/inference/v1/generate", body, key, session)


def test_only_the_runs_keys_are_served(endpoint, policy):
    tokenizer = policy[0]
    ids = prompt(tokenizer, "What is 1+2?")
    episode = endpoint.open_episode(step=0, index=0, budget=16)
    try:
        assert generate(endpoint, None, ids, max_tokens=4)[0] == 401
        assert generate(endpoint, "not-the-key", ids, max_tokens=4)[0] == 401
        assert generate(endpoint, endpoint.api_key + "x", ids, episode.session_id, max_tokens=4)[0] == 401
        assert generate(endpoint, endpoint.api_key, ids, max_tokens=4)[0] == 400  # which episode?
        assert generate(endpoint, endpoint.api_key, ids, "no-such-session", max_tokens=4)[0] == 404
        models = urllib.request.Request(f"{endpoint.base_url}/models", headers={})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(models, timeout=30)
        assert refused.value.code == 401
        models.add_header("Authorization", f"Bearer {endpoint.api_key}")
        with urllib.request.urlopen(models, timeout=30) as response:
            listed = json.loads(response.read())["data"]
        assert [m["id"] for m in listed] == ["policy"] and listed[0]["max_model_len"] == endpoint.sampler.max_model_len
        # The run's key with the session, or the episode's own key: both served.
        assert generate(endpoint, endpoint.api_key, ids, episode.session_id, max_tokens=4)[0] == 200
        assert generate(endpoint, episode.api_key, ids, max_tokens=4)[0] == 200
        assert episode.api_key not in repr(episode) and episode.api_key not in repr(endpoint.close_episode(episode.session_id))
    finally:
        if episode.session_id in endpoint._episodes:
            endpoint.close_episode(episode.session_id)


def test_token_route_shapes_and_sampler_logprobs_equal_the_trainers(endpoint, policy):
    tokenizer, lm, _, _ = policy
    ids = prompt(tokenizer, "What is 13+4?")
    episode = endpoint.open_episode(step=3, index=1, budget=16)
    status, out = generate(endpoint, episode.api_key, ids, max_tokens=12, temperature=0.0, top_p=0.1)
    record = endpoint.close_episode(episode.session_id)
    assert status == 200, out
    choice = out["choices"][0]
    tokens = choice["token_ids"]
    assert 1 <= len(tokens) <= 12 and out["prompt_token_ids"] == ids and isinstance(out["request_id"], str)
    assert choice["finish_reason"] == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]
    assert [c["token_id"] for c in content] == tokens
    [turn] = record.turns
    assert (turn.turn, turn.prompt_ids, turn.completion_ids) == (0, ids, tokens)
    assert turn.logprobs == [c["logprob"] for c in content]
    # The request's temperature 0 and top-p were overridden by the run's (0.9, 1.0): the trainer scores at 0.9.
    batch = make_sequence_batch([ids], [tokens], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = TokenLogprobs(lm, temperature=0.9)(**batch.tensors())
    torch.testing.assert_close(torch.tensor(turn.logprobs), trainer[0, : len(tokens)], atol=2e-5, rtol=2e-5)


def test_sample_rows_batched_equals_alone_and_seeded_generate(policy):
    tokenizer, _, engine, _ = policy
    prompts = [prompt(tokenizer, q) for q in ("What is 1+2?", "hi", "What is 100+200?")]
    seeds, limits = [11, 22, 33], [16, 5, 16]
    state = torch.get_rng_state()
    batched = engine.sample_rows(prompts, seeds, limits)
    assert torch.equal(torch.get_rng_state(), state)  # the run's own stream is untouched
    assert batched.finish_reasons[1] == "length" and len(batched.completion_ids[1]) == 5
    for i in range(3):
        alone = engine.sample_rows([prompts[i]], [seeds[i]], [limits[i]])
        assert alone.completion_ids[0] == batched.completion_ids[i]
        seeded = engine.generate([prompts[i]], 1, seeds=[seeds[i]], max_tokens=limits[i])
        assert seeded.completion_ids[0] == alone.completion_ids[0]


def test_concurrent_requests_are_batched_and_give_the_sequential_tokens(endpoint, policy):
    tokenizer = policy[0]
    questions = ["What is 1+2?", "What is 13+4?", "hi", "What is 7+8?", "What is 100+200?", "Say yes."]
    prompts = [prompt(tokenizer, q) for q in questions]

    def episode_program(key, first):  # two turns: the second continues the first
        _, a = generate(endpoint, key, first, max_tokens=6)
        second = first + a["choices"][0]["token_ids"] + prompt(tokenizer, "And then?")
        _, b = generate(endpoint, key, second, max_tokens=6)
        return a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]

    def run(concurrent: bool):
        results: list = [None] * len(prompts)
        if not concurrent:  # one episode open at a time: its batches need not wait for the others
            for i in range(len(prompts)):
                handle = endpoint.open_episode(step=2, index=i, budget=12)
                results[i] = episode_program(handle.api_key, prompts[i])
                endpoint.close_episode(handle.session_id)
            return results, None
        handles = [endpoint.open_episode(step=2, index=i, budget=12) for i in range(len(prompts))]
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, episode_program(handles[i].api_key, prompts[i])))
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, [endpoint.close_episode(h.session_id) for h in handles]

    before = endpoint.counters().get("agent/batches", 0)
    concurrent, records = run(concurrent=True)
    batches = endpoint.counters()["agent/batches"] - before
    sequential, _ = run(concurrent=False)
    assert concurrent == sequential
    # Every open episode had its request waiting: one batch per turn, not one per request.
    assert batches == 2
    assert len({tuple(c[0]) for c in concurrent}) > 1  # the episodes' streams differ
    for record in records:
        assert [t.turn for t in sorted(record.turns, key=lambda t: t.turn)] == [0, 1]
        assert record.turn(1).parent == 0
        [branch] = record.branches()
        first, second = record.turn(0), record.turn(1)
        assert branch.prompt_ids == first.prompt_ids and branch.completion_ids == second.tokens[len(first.prompt_ids) :]
        sampled = [i for i, m in enumerate(branch.completion_mask) if m]
        assert len(sampled) == len(first.completion_ids) + len(second.completion_ids)
        assert [branch.logprobs[i] for i in sampled] == first.logprobs + second.logprobs


def chat_client(endpoint, key):
    import openai

    return openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=120)


def test_chat_turns_reuse_the_sampled_tokens_and_stream_the_same_reply(endpoint, policy):
    tokenizer = policy[0]
    episode = endpoint.open_episode(step=5, index=0, budget=16)
    client = chat_client(endpoint, episode.api_key)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, logprobs=True)
    reply = first.choices[0].message.content
    assert len(first.choices[0].logprobs.content) == first.usage.completion_tokens
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    record = endpoint.close_episode(episode.session_id)
    turn0, turn1 = record.turn(0), record.turn(1)
    assert turn1.parent == 0 and record.rerendered_turns == 0
    assert turn1.prompt_ids[: len(turn0.tokens)] == turn0.tokens  # the sampled ids, not a re-tokenized reply
    assert len(record.branches()) == 1

    # The same keys (step, episode, turn) streamed: the same reply, in chunks.
    again = endpoint.open_episode(step=5, index=0, budget=16)
    stream = chat_client(endpoint, again.api_key).chat.completions.create(
        model="policy", messages=messages[:1], max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    endpoint.close_episode(again.session_id)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == first.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens


def test_a_conversation_rendered_differently_is_counted_and_branched(policy):
    tokenizer, _, _, sampler = policy
    # A template that renders earlier assistant turns unlike what was sampled (as reasoning templates drop <think>).
    altered = copy.deepcopy(tokenizer)
    altered.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
        "{% if m['role'] == 'assistant' %}{{ '~' }}{% endif %}{{ m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with TokenEndpoint(sampler, altered, seed=7, limits=LIMITS) as server:
        episode = server.open_episode(step=0, index=0, budget=16)
        client = chat_client(server, episode.api_key)
        messages = [{"role": "user", "content": "What is 2+2?"}]
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        record = server.close_episode(episode.session_id)
        assert server.counters()["agent/rerendered_turns"] == 1
    assert record.rerendered_turns == 1 and record.turn(1).rerendered and record.turn(1).parent is None
    assert len(record.branches()) == 2  # each trained on as it was sampled


def test_bad_requests_are_refused_and_the_server_goes_on(endpoint, policy):
    tokenizer = policy[0]
    ids = prompt(tokenizer, "What is 1+2?")
    episode = endpoint.open_episode(step=9, index=0, budget=6)
    key, url = episode.api_key, f"{endpoint.url}/inference/v1/generate"
    try:
        assert post(url, None, key, raw=b"{not json")[0] == 400
        assert post(url, [1, 2], key)[0] == 400
        assert post(url, None, key, raw=b" " * 30_000)[0] == 413  # over max_body_bytes
        assert generate(endpoint, key, [10**6], max_tokens=2)[0] == 400  # not a token id
        assert generate(endpoint, key, [], max_tokens=2)[0] == 400
        assert generate(endpoint, key, [5] * 300, max_tokens=2)[0] == 413  # over max_request_tokens
        assert generate(endpoint, key, ids, max_tokens=0)[0] == 400
        assert generate(endpoint, key, ids, max_tokens=2, n=2)[0] == 400
        status, body = post(f"{endpoint.url}/inference/v1/generate", {"model": "other", "token_ids": ids}, key)
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert post(f"{endpoint.url}/v1/nothing", {}, key)[0] == 404
        status, body = post(f"{endpoint.base_url}/chat/completions", {"model": "policy", "messages": "hi"}, key)
        assert status == 400 and "messages" in body["error"]["message"]
        # A flood of one episode: at most max_in_flight_per_episode at a time, the rest refused, nothing crashes.
        statuses: list[int] = []
        threads = [
            threading.Thread(target=lambda: statuses.append(generate(endpoint, key, ids, max_tokens=1)[0]))
            for _ in range(12)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(statuses) <= {200, 429, 400} and 200 in statuses
        # Over budget: max_tokens is capped by what is left; then nothing is left.
        while (result := generate(endpoint, key, ids, max_tokens=50))[0] == 200:
            assert len(result[1]["choices"][0]["token_ids"]) <= 6
        assert result[0] == 400 and result[1]["error"]["code"] == "budget_exhausted"
    finally:
        record = endpoint.close_episode(episode.session_id)
    assert record.tokens_used == 6 and record.refused["budget_exhausted"] >= 1
    # Still serving.
    other = endpoint.open_episode(step=9, index=1, budget=4)
    assert generate(endpoint, other.api_key, ids, max_tokens=2)[0] == 200
    endpoint.close_episode(other.session_id)


def test_the_server_closes(policy):
    tokenizer, _, _, sampler = policy
    server = TokenEndpoint(sampler, tokenizer, seed=0).start()
    port = server.port
    episode = server.open_episode(step=0, index=0, budget=4)
    assert generate(server, episode.api_key, prompt(tokenizer, "hi"), max_tokens=2)[0] == 200
    server.close()
    server.close()  # twice: nothing left to do
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


class RecordingSampler:
    """Stands in for an engine: answers each request with one token (its seed's), and records every batch."""

    max_model_len, max_batch, vocab_size = 512, 4, None

    def __init__(self):
        self.batches: list[list[tuple[int, int]]] = []  # per batch: (prompt length, seed) of each request, in order

    def sample(self, requests):
        from grpo_trainer.agents.sampler import TokenResult

        self.batches.append([(len(r.prompt_ids), r.seed) for r in requests])
        return [TokenResult([r.seed % 50 + 10], [-1.0], "length") for r in requests]


def test_rounds_make_every_batch_the_same_whatever_the_timing(policy):
    """rounds=True (rollout.seed_per_prompt): 7 episodes of 1-3 sequential turns, 3 playing at a time (one starts as
    one ends, as the agent engine runs them), each waiting a random 0-60 ms before each request: two runs with
    different waits form the same batches, request for request in the same order, and no batch mixes rounds
    (so what each request samples cannot depend on the machine's load). A time window (rounds=False, 20 ms) would
    batch whatever arrived in time."""
    import random
    import time as clock

    tokenizer = policy[0]

    def run(jitter_seed: int) -> list[list[tuple[int, int]]]:
        sampler, rng = RecordingSampler(), random.Random(jitter_seed)
        waits = [[rng.uniform(0, 0.06) for _ in range(3)] for _ in range(7)]
        with TokenEndpoint(sampler, tokenizer, seed=3, rounds=True) as server:
            handles = [server.open_episode(step=1, index=i, budget=8) for i in range(7)]
            places, lock, queue = threading.Semaphore(3), threading.Lock(), list(range(7))

            def play(i: int) -> None:
                try:
                    tokens = [1] * (i + 2)
                    for turn in range(1 + i % 3):
                        clock.sleep(waits[i][turn])
                        status, reply = generate(server, handles[i].api_key, tokens, max_tokens=1)
                        assert status == 200, reply
                        tokens = tokens + reply["choices"][0]["token_ids"] + [2]
                finally:
                    with lock:
                        successor = bool(queue)
                    server.play_ended(handles[i].session_id, successor)
                    places.release()

            def lane() -> None:
                while True:
                    with lock:
                        if not queue:
                            return
                        i = queue.pop(0)
                    places.acquire()
                    server.play_started(handles[i].session_id)
                    play(i)

            server.expect_players(3)
            lanes = [threading.Thread(target=lane) for _ in range(3)]
            for t in lanes:
                t.start()
            for t in lanes:
                t.join()
            for h in handles:
                server.close_episode(h.session_id)
        return sampler.batches

    first, second = run(1), run(2)
    assert first == second
    assert sum(map(len, first)) == sum(1 + i % 3 for i in range(7))
    assert all(len(batch) <= RecordingSampler.max_batch for batch in first)
    assert len(first[0]) == 3  # the first round: the first request of each of the 3 episodes that started


def test_a_round_missing_an_episode_is_taken_after_the_round_timeout_and_said(policy, caplog):
    """rounds=True with an episode in play that never asks (an agent stuck in its own work): the others' requests
    are answered after limits.round_timeout_s, not never; counted (agent/rounds_cut) and logged once."""
    tokenizer = policy[0]
    sampler = RecordingSampler()
    limits = EndpointLimits(round_timeout_s=0.5)
    with caplog.at_level("WARNING"), TokenEndpoint(sampler, tokenizer, seed=3, rounds=True, limits=limits) as server:
        asking, stuck = server.open_episode(step=1, index=0, budget=8), server.open_episode(step=1, index=1, budget=8)
        server.expect_players(2)
        server.play_started(asking.session_id)
        server.play_started(stuck.session_id)
        status, reply = generate(server, asking.api_key, [1, 2, 3], max_tokens=1)
        assert status == 200, reply
        assert server.counters().get("agent/rounds_cut") == 1
        server.play_ended(stuck.session_id, successor=False)
        assert generate(server, asking.api_key, [1, 2, 3, 4], max_tokens=1)[0] == 200  # a full round: no cut
        assert server.counters().get("agent/rounds_cut") == 1
    assert sum("a round was taken after 0.5 s" in r.getMessage() for r in caplog.records) == 1
