"""The policy behind a token endpoint: agent programs sample from the run's engine over HTTP, every request recorded.

`TokenEndpoint(sampler, tokenizer, seed=...)` serves, on 127.0.0.1 and a free port, for the life of a `with` block
(or `start()` .. `close()`):

* `POST /inference/v1/generate`: vLLM's token route (vllm/entrypoints/scale_out/token_in_token_out/): `token_ids`
  and `sampling_params` in; `choices[0].token_ids`, `choices[0].logprobs.content[i]` (`token` as
  "token_id:<id>", `token_id`, `logprob`), `choices[0].finish_reason` ("stop" | "length"), `prompt_token_ids`,
  `request_id` out. What verifiers' train client sends (docs/agents.md).
* `POST /v1/chat/completions`: OpenAI's chat route, non-streaming and streaming (SSE), rendered with the policy's
  chat template, token-faithfully across turns (chat.py).
* `GET /v1/models`: the one model, with its `max_model_len`.

Security: every request must carry `Authorization: Bearer <key>`, the run's key (`api_key`, from `secrets`, made
per endpoint) together with `X-Session-ID: <an open episode>`, or an episode's own key (`open_episode(...).api_key`,
which names its episode). Keys are never logged (no access log is kept; refused requests are counted, not logged).
The socket listens on loopback only. Bodies over `limits.max_body_bytes`, prompts over `limits.max_request_tokens`,
more than `limits.max_pending` requests waiting (or `limits.max_in_flight_per_episode` for one episode) are refused
with an HTTP error, as are malformed requests; none of them reaches the engine, and the server goes on serving.

Sampling: requests carry no sampling settings the engine reads but their stop tokens and length: the engine samples
at the run's (so an agent's temperature or top-p is overridden), and `max_tokens` is capped by what the episode has
left of its completion budget (`open_episode(budget=...)`, rollout.max_completion_length) and by the context length;
an episode with nothing left is refused (400, `budget_exhausted`). Each request's seed is
`mix_seed(seed, step, episode index, turn)`, the turn being the request's position in its episode, so its tokens
do not depend on which requests it was batched with or when it arrived (for an agent whose requests within one
episode are sequential).

Batching: requests wait in one queue; the batcher takes what arrived within `limits.batch_window_s` of the first
(sooner once every open episode has a request waiting, or `sampler.max_batch` are), and samples them in one call
of the engine, on one worker thread, while the server keeps accepting.

With `rounds=True` (the agent engine under rollout.seed_per_prompt) batches are *rounds* instead, so that what each
request samples depends on nothing but its seed and the episodes' own behaviour: no engine's batched kernels are
exactly row-invariant (the hf engine's prefill rounds differently for 1 row and 2; vLLM's batches are not
batch-invariant either), so a time window, which lets the machine's load decide which requests share a batch,
would let it decide the last bits of their log-probs too, and now and then a token. A round is taken when every
*playing* episode (`play_started` .. `play_ended`, told by the engine that runs them) has a request waiting and no
episode is about to start in a finished one's place; its requests are sampled in episode order (step, index),
`sampler.max_batch` at a time. So a round holds the next request of every episode in play, whatever the timing,
for agents whose requests within one episode are sequential; an agent that works between its requests holds the
round up (within environment.episode_timeout, which counts the wait as the endpoint's time, not the agent's), for
at most `limits.round_timeout_s`, after which the round is taken as it is (counted, `agent/rounds_cut`, and logged
once: from there on batching may depend on timing).

Records: `close_episode(session_id)` returns the episode's `EpisodeRequests` (records.py), every request token for
token with the sampler's log-probs; `counters()` gives the endpoint's totals (`agent/rerendered_turns`, ...).

The producers that run programs against it and train on its records: producer.py (the seam), engine.py. Not done
here: tool-call parsing on the chat route (tools are rendered into the prompt; replies are plain text), stop strings
per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..seeds import mix_seed
from .chat import BadMessages, chat_prompt, normalize_messages
from .records import EpisodeRequests, TurnRecord
from .sampler import TokenRequest, TokenResult, TokenSampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointLimits:
    max_body_bytes: int = 4 * 2**20  # a request's body
    max_request_tokens: int = 32_768  # a request's prompt ids (also capped by the context length)
    max_pending: int = 1024  # requests admitted and not yet answered, all episodes together
    max_in_flight_per_episode: int = 16  # of one episode
    batch_window_s: float = 0.02  # how long the batcher waits for more requests after the first
    # rounds: how long a round waits for every episode in play after its first request, before it is taken as it is
    # (logged once: an agent that works this long between requests makes batching depend on timing again)
    round_timeout_s: float = 30.0


@dataclass(frozen=True)
class EpisodeHandle:
    """What an episode's program needs to reach the endpoint."""

    session_id: str
    base_url: str  # OpenAI-style: ".../v1" (the token route is at the same host, /inference/v1/generate)
    api_key: str = field(repr=False)  # the episode's own key: never printed
    model: str = "policy"  # the model name the endpoint serves (`model` in requests; GET /v1/models)


class HTTPError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class _Episode:
    record: EpisodeRequests
    reserved: int = 0  # max_tokens of this episode's requests in flight
    in_flight: int = 0
    closed: bool = False
    idle: asyncio.Event | None = None  # set when nothing is in flight (made on the server's loop)
    # Time with at least one of its requests admitted and not yet answered (waiting for a batch, or sampled):
    # what environment.episode_timeout does not count (producer.py).
    sampler_seconds: float = 0.0
    sampler_since: float | None = None  # when the current stretch of requests in flight began
    playing: bool = False  # its program is running (rounds: the batcher waits for its next request)


# The request's episode (None: the run's key without a session), set by the guard.
EPISODE: web.RequestKey[_Episode | None] = web.RequestKey("episode", _Episode)


class TokenEndpoint:
    def __init__(
        self,
        sampler: TokenSampler,
        tokenizer,
        *,
        seed: int,
        eos_token_ids: list[int] | None = None,
        model_name: str = "policy",
        limits: EndpointLimits = EndpointLimits(),
        rounds: bool = False,
    ):
        self.sampler = sampler
        self.rounds = rounds  # batches are rounds of the playing episodes, not time windows (module docstring)
        self._starting = 0  # rounds: episodes that will start playing in finished ones' places
        self._warned_cut = False
        self.tokenizer = tokenizer
        self.seed = seed
        self.model_name = model_name
        self.limits = limits
        # Token ids a request may hold: the tokenizer's, or the policy's rows where it has more (a vocabulary padded
        # to a multiple: the policy can sample those ids, and an agent sends back what it sampled).
        self.vocab_size = max(len(tokenizer), getattr(sampler, "vocab_size", None) or 0)
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = {int(t) for t in eos if t is not None}
        self.api_key = secrets.token_urlsafe(32)  # the run's key: hand it to episodes, never log it
        self._episodes: dict[str, _Episode] = {}
        self._by_key: dict[str, str] = {}  # episode key -> session id
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()  # the maps above, between the server's thread and the run's
        self._pending: list[tuple[TokenRequest, str, asyncio.Future]] = []
        self._admitted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._wakeup: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="endpoint-sampler")
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle (the run's thread)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the endpoint is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> TokenEndpoint:
        if self._thread is not None:
            return self
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="token-endpoint", daemon=True)
        self._thread.start()
        self.port = ready.result(timeout=60)
        return self

    def close(self) -> None:
        """Stop serving: requests waiting are answered 503, a batch being sampled is finished, the port freed."""
        if self._thread is None or self._loop is None:
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=300)
            self._loop.call_soon_threadsafe(self._loop.stop)  # after _shutdown's result was delivered
        self._thread.join(timeout=60)
        self._worker.shutdown(wait=True)
        self._thread = None

    def __enter__(self) -> TokenEndpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def open_episode(self, *, step: int, index: int, budget: int, session_id: str | None = None) -> EpisodeHandle:
        """Register an episode: `index` is its position in step `step` (its requests' seeds derive from both),
        `budget` the completion tokens it may sample in all. Returns its session id, its own key and the URL."""
        session_id = session_id or f"episode-{step}-{index}-{uuid.uuid4().hex[:8]}"
        key = secrets.token_urlsafe(32)
        record = EpisodeRequests(session_id=session_id, step=step, index=index, budget=budget, api_key=key)
        with self._lock:
            if session_id in self._episodes:
                raise ValueError(f"episode {session_id!r} is already open")
            self._episodes[session_id] = _Episode(record)
            self._by_key[key] = session_id
        return EpisodeHandle(session_id, self.base_url, key, self.model_name)

    def expect_players(self, count: int) -> None:
        """Rounds: `count` episodes are about to start playing (a batch's first, before any has started), so that no
        round is taken before each has started and sent its first request. Any thread."""
        with self._lock:
            self._starting = count
        self._wake()

    def play_started(self, session_id: str) -> None:
        """The episode's program runs from now on (rounds: the batcher waits for its requests). Any thread."""
        with self._lock:
            episode = self._episodes.get(session_id)
            if episode is None:  # closed already (a play of an abandoned players' loop): nothing to count
                return
            episode.playing = True
            self._starting = max(self._starting - 1, 0)
        self._wake()

    def play_ended(self, session_id: str, successor: bool) -> None:
        """The episode's program returned (or failed); `successor`: another episode starts in its place, which the
        next round waits for (told in the same breath, so no round can be taken between the two). Any thread."""
        with self._lock:
            episode = self._episodes.get(session_id)
            if episode is None:  # closed already (a play of an abandoned players' loop): its batch is over
                return
            episode.playing = False
            self._starting += 1 if successor else 0
        self._wake()

    def _wake(self) -> None:
        if self._loop is not None and self._wakeup is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def close_episode(self, session_id: str) -> EpisodeRequests:
        """Refuse the episode's further requests, wait for those in flight, and return its record (final)."""
        if self._loop is None or self._thread is None:
            raise RuntimeError("the endpoint is not started")
        return asyncio.run_coroutine_threadsafe(self._close_episode(session_id), self._loop).result()

    def sampler_seconds(self, session_id: str) -> float:
        """Seconds the episode has had requests in the endpoint (waiting for a batch or being sampled), the stretch
        going on now included; 0.0 for an episode no longer open. Any thread."""
        with self._lock:
            episode = self._episodes.get(session_id)
            if episode is None:
                return 0.0
            since = episode.sampler_since
            return episode.sampler_seconds + (time.perf_counter() - since if since is not None else 0.0)

    def counters(self) -> dict[str, int]:
        """Totals since start: agent/requests, agent/batches, agent/rerendered_turns, agent/refused/<code>, ..."""
        with self._lock:
            return dict(self._counters)

    # ------------------------------------------------------------------ the server's thread

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(ready))
            loop.run_forever()  # until _shutdown stops it
        except BaseException as exc:  # noqa: BLE001 (reported to start(), which raises it)
            if not ready.done():
                ready.set_exception(exc)
            else:
                logger.exception("token endpoint: the server's loop failed")
        finally:
            loop.close()

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)  # no access log: no headers logged
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._wakeup = asyncio.Event()
        self._batcher = asyncio.create_task(self._batch_loop())
        ready.set_result(self._runner.addresses[0][1])

    async def _shutdown(self) -> None:
        assert self._runner is not None and self._batcher is not None
        self._batcher.cancel()
        for _, _, future in self._pending:
            if not future.done():
                future.set_exception(HTTPError(503, "shutting_down", "the endpoint is closing"))
        self._pending.clear()
        await self._runner.cleanup()

    async def _close_episode(self, session_id: str) -> EpisodeRequests:
        with self._lock:
            episode = self._episodes.get(session_id)
            if episode is None:
                raise KeyError(f"no open episode {session_id!r}")
            episode.closed = True
            # Episodes are closed once their batch is over: no round waits for it, or for another to start (a play
            # abandoned with its loop may have been left "playing", with requests of others waiting on it).
            self._starting = 0
        if self._wakeup is not None:
            self._wakeup.set()
        while episode.in_flight:
            if episode.idle is None:
                episode.idle = asyncio.Event()
            episode.idle.clear()
            await episode.idle.wait()
        with self._lock:
            del self._episodes[session_id]
            self._by_key.pop(episode.record.api_key, None)
            episode.record.sampler_seconds = episode.sampler_seconds
        return episode.record

    def _count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + by

    # -- errors and authentication, for every route

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            request[EPISODE] = self._authenticate(request)
            if request.content_length is not None and request.content_length > self.limits.max_body_bytes:
                raise HTTPError(413, "body_too_large", f"the body exceeds {self.limits.max_body_bytes} bytes")
            return await handler(request)
        except HTTPError as exc:
            return self._refuse(request, exc)
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(
                request, HTTPError(413, "body_too_large", f"the body exceeds {self.limits.max_body_bytes} bytes")
            )
        except web.HTTPException as exc:  # aiohttp's own: no such route, wrong method
            return self._refuse(request, HTTPError(exc.status, "http_error", exc.reason))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug of ours or a failing sampler: this request fails, the server goes on
            logger.exception("token endpoint: %s %s failed", request.method, request.path)
            return self._refuse(request, HTTPError(500, "internal_error", f"{type(exc).__name__}: {exc}"))

    def _refuse(self, request: web.Request, error: HTTPError) -> web.Response:
        self._count(f"agent/refused/{error.code}")
        episode = request.get(EPISODE)
        if episode is not None:
            refused = episode.record.refused
            refused[error.code] = refused.get(error.code, 0) + 1
        body = {"error": {"message": error.message, "type": error.code, "code": error.code}}
        return web.json_response(body, status=error.status)

    def _authenticate(self, request: web.Request) -> _Episode | None:
        """The episode the request is for (None: the run's key without a session, enough for /v1/models)."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise HTTPError(401, "unauthorized", "missing 'Authorization: Bearer <key>'")
        key = key.strip()
        with self._lock:
            session = self._by_key.get(key)
            if session is None and hmac.compare_digest(key.encode(), self.api_key.encode()):
                session = request.headers.get("X-Session-ID")
                if session is None:
                    return None
                if session not in self._episodes:
                    raise HTTPError(404, "unknown_session", "X-Session-ID names no open episode")
            if session is None:
                raise HTTPError(401, "unauthorized", "the key is not this endpoint's")
            episode = self._episodes[session]
        if episode.closed:
            raise HTTPError(410, "episode_closed", "the episode is closed")
        return episode

    # -- routes

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "grpo-trainer",
            "max_model_len": self.sampler.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _generate(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        body = await self._body(request)
        self._check_model(body)
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise HTTPError(400, "invalid_request", "'sampling_params' must be an object")
        prompt = self._token_ids(body.get("token_ids"), "token_ids")
        stops = self._token_ids(params.get("stop_token_ids") or [], "sampling_params.stop_token_ids", empty=True)
        self._check_common(params)
        parent = episode.record.find_parent(prompt)
        result, record = await self._serve_turn(
            episode, "generate", prompt, params.get("max_tokens"), stops, parent=parent
        )
        request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else f"gen-{uuid.uuid4().hex}"
        last = result.completion_ids[-1] if result.completion_ids else None
        custom = set(stops) - self.eos_token_ids
        stop_reason = last if result.finish_reason == "stop" and last in custom else None
        content = [
            {"token": f"token_id:{t}", "token_id": t, "logprob": lp, "top_logprobs": []}
            for t, lp in zip(result.completion_ids, result.logprobs)
        ]
        return web.json_response(
            {
                "request_id": request_id,
                "model": self.model_name,
                "created": int(time.time()),
                "output_mode": "tokens",
                "prompt_token_ids": prompt,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": result.completion_ids,
                        "logprobs": {"content": content},
                        "finish_reason": result.finish_reason,
                        "stop_reason": stop_reason,
                    }
                ],
                "usage": self._usage(prompt, result),
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await self._body(request)
        self._check_model(body)
        self._check_common(body)
        try:
            messages = normalize_messages(body.get("messages"))
            prompt, parent, rerendered = chat_prompt(
                self.tokenizer, episode.record, messages, self._turn_content, body.get("tools")
            )
        except BadMessages as exc:
            raise HTTPError(400, "invalid_request", str(exc)) from None
        if rerendered:
            episode.record.rerendered_turns += 1
            self._count("agent/rerendered_turns")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        result, record = await self._serve_turn(
            episode, "chat", prompt, max_tokens, [], parent=parent, rerendered=rerendered, messages=messages
        )
        text = self._reply_text(record)
        created, completion_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            return await self._stream_chat(request, body, completion_id, created, prompt, result)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {
                "content": [self._logprob_entry(t, lp) for t, lp in zip(result.completion_ids, result.logprobs)]
            }
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": result.finish_reason,
                        "token_ids": result.completion_ids,
                    }
                ],
                "prompt_token_ids": prompt,
                "usage": self._usage(prompt, result),
            }
        )

    async def _stream_chat(
        self, request: web.Request, body: dict, completion_id: str, created: int, prompt: list[int], result: TokenResult
    ) -> web.StreamResponse:
        """The completion as SSE chunks, one per token's text (sampled first, then sent: the hf engine decodes a
        batch to its end), then the finish reason, the usage if asked for, and `[DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(choices: list[dict], **extra) -> None:
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                **extra,
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        content_ids = self._content_ids(result.completion_ids)
        sent = ""
        for i in range(len(content_ids)):
            text = self.tokenizer.decode(content_ids[: i + 1], skip_special_tokens=False)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of it
                continue
            if len(text) > len(sent) and text.startswith(sent):
                await send([{"index": 0, "delta": {"content": text[len(sent) :]}, "finish_reason": None}])
                sent = text
        whole = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        if whole != sent and whole.startswith(sent):
            await send([{"index": 0, "delta": {"content": whole[len(sent) :]}, "finish_reason": None}])
        await send([{"index": 0, "delta": {}, "finish_reason": result.finish_reason}])
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await send([], usage=self._usage(prompt, result))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- one request through the batcher

    async def _serve_turn(
        self,
        episode: _Episode,
        route: str,
        prompt: list[int],
        max_tokens: Any,
        stops: list[int],
        parent: int | None,
        rerendered: bool = False,
        messages: list[dict] | None = None,
    ) -> tuple[TokenResult, TurnRecord]:
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise HTTPError(400, "invalid_request", "'max_tokens' must be a positive integer")
        if len(prompt) > self.limits.max_request_tokens:
            raise HTTPError(413, "too_many_tokens", f"the prompt exceeds {self.limits.max_request_tokens} tokens")
        record = episode.record
        left = record.budget - record.tokens_used - episode.reserved
        if left <= 0:
            raise HTTPError(
                400, "budget_exhausted", f"the episode has no completion tokens left of its {record.budget}"
            )
        room = self.sampler.max_model_len - len(prompt)
        if room <= 0:
            raise HTTPError(
                400, "context_length_exceeded", f"the prompt fills the context ({self.sampler.max_model_len} tokens)"
            )
        if self._admitted >= self.limits.max_pending:
            raise HTTPError(429, "too_many_requests", "the endpoint has too many requests waiting")
        if episode.in_flight >= self.limits.max_in_flight_per_episode:
            raise HTTPError(429, "too_many_requests", "the episode has too many requests in flight")
        cap = min(max_tokens or left, left, room)
        turn = record.next_turn
        record.next_turn += 1
        seed = mix_seed(self.seed, record.step, record.index, turn)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        episode.reserved += cap
        with self._lock:
            if episode.in_flight == 0:
                episode.sampler_since = time.perf_counter()
            episode.in_flight += 1
        self._admitted += 1
        self._pending.append((TokenRequest(prompt, cap, seed, tuple(stops)), record.session_id, future))
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            result = await future
        finally:
            episode.reserved -= cap
            with self._lock:
                episode.in_flight -= 1
                if episode.in_flight == 0 and episode.sampler_since is not None:
                    episode.sampler_seconds += time.perf_counter() - episode.sampler_since
                    episode.sampler_since = None
            self._admitted -= 1
            if episode.in_flight == 0 and episode.idle is not None:
                episode.idle.set()
        turn_record = TurnRecord(
            turn=turn,
            route=route,
            prompt_ids=list(prompt),
            completion_ids=result.completion_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            seed=seed,
            parent=parent,
            rerendered=rerendered,
            messages=messages,
        )
        record.turns.append(turn_record)
        self._count("agent/requests")
        self._count("agent/completion_tokens", len(result.completion_ids))
        return result, turn_record

    async def _batch_loop(self) -> None:
        """Gather, sample, answer; forever (cancelled at close)."""
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            ready = self._round_ready if self.rounds else self._batch_ready
            deadline = loop.time() + (self.limits.round_timeout_s if self.rounds else self.limits.batch_window_s)
            while not ready() and (wait := deadline - loop.time()) > 0:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=wait)
                except TimeoutError:
                    break
            if self.rounds:
                if not ready():
                    self._cut_round()
                self._pending.sort(key=self._episode_order)  # stable: an episode's requests in arrival order
            batch = self._pending[: self.sampler.max_batch]
            del self._pending[: len(batch)]
            self._count("agent/batches")
            try:
                results = await loop.run_in_executor(self._worker, self.sampler.sample, [r for r, _, _ in batch])
            except Exception as exc:
                logger.exception("token endpoint: the sampler failed on a batch of %d", len(batch))
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(HTTPError(500, "sampler_failed", f"{type(exc).__name__}: {exc}"))
            else:
                for (_, _, future), result in zip(batch, results):
                    if not future.done():
                        future.set_result(result)
            if self._pending:
                self._wakeup.set()

    def _cut_round(self) -> None:
        self._count("agent/rounds_cut")
        if not self._warned_cut:
            self._warned_cut = True
            logger.warning(
                "token endpoint: a round was taken after %g s without the next request of every episode in play (an "
                "agent works that long between its requests, or is stuck): which requests share a batch, and so the "
                "last bits of their log-probs, may depend on timing from here on (counted: agent/rounds_cut)",
                self.limits.round_timeout_s,
            )

    def _round_ready(self) -> bool:
        """Rounds: every playing episode has a request waiting, and none is about to start."""
        waiting = {session for _, session, _ in self._pending}
        with self._lock:
            if self._starting:
                return False
            return all(s in waiting for s, e in self._episodes.items() if e.playing and not e.closed)

    def _episode_order(self, item: tuple[TokenRequest, str, asyncio.Future]) -> tuple[int, int]:
        with self._lock:
            episode = self._episodes.get(item[1])
        return (episode.record.step, episode.record.index) if episode is not None else (-1, -1)

    def _batch_ready(self) -> bool:
        """Full, or every open episode has a request waiting (no more can be expected from sequential agents)."""
        if len(self._pending) >= self.sampler.max_batch:
            return True
        waiting = {session for _, session, _ in self._pending}
        with self._lock:
            return all(s in waiting for s, e in self._episodes.items() if not e.closed)

    # -- request parts

    def _episode(self, request: web.Request) -> _Episode:
        episode = request.get(EPISODE)
        if episode is None:
            raise HTTPError(400, "missing_session", "send an episode's key, or the run's key with X-Session-ID")
        return episode

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "invalid_json", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "invalid_request", "the body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise HTTPError(404, "model_not_found", f"this endpoint serves the model {self.model_name!r}")

    def _check_common(self, params: dict) -> None:
        n = params.get("n", 1)
        if n not in (None, 1):
            raise HTTPError(400, "invalid_request", "one completion per request ('n' must be 1)")
        if params.get("stop"):
            raise HTTPError(400, "invalid_request", "stop strings per request are not served (use stop_token_ids)")

    def _token_ids(self, value: Any, name: str, empty: bool = False) -> list[int]:
        if not isinstance(value, list) or (not value and not empty):
            raise HTTPError(400, "invalid_request", f"'{name}' must be a non-empty list of token ids")
        if len(value) > self.limits.max_request_tokens:
            raise HTTPError(413, "too_many_tokens", f"'{name}' exceeds {self.limits.max_request_tokens} tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in value):
            raise HTTPError(400, "invalid_request", f"'{name}' must hold token ids in [0, {self.vocab_size})")
        return list(value)

    def _content_ids(self, completion_ids: list[int]) -> list[int]:
        """A chat reply's content: the completion without the EOS token it ended on."""
        if completion_ids and completion_ids[-1] in self.eos_token_ids:
            return completion_ids[:-1]
        return completion_ids

    def _turn_content(self, turn: TurnRecord) -> list[int]:
        return self._content_ids(turn.completion_ids)

    def _reply_text(self, turn: TurnRecord) -> str:
        return self.tokenizer.decode(self._turn_content(turn), skip_special_tokens=False)

    def _logprob_entry(self, token: int, logprob: float) -> dict:
        piece = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}

    @staticmethod
    def _usage(prompt: list[int], result: TokenResult) -> dict:
        n = len(result.completion_ids)
        return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
