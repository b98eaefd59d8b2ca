"""A remote OpenEnv server (`environment.url: openenv+ws://HOST:PORT`), spoken to over its `/ws` protocol.

Our own client, on the `websockets` package's sync API (the `env` extra), so a remote environment needs no
openenv install (openenv 0.10 cannot share an environment with vLLM 0.32: docs/environments.md). The protocol, as
openenv 0.10's server speaks it (`openenv/core/env_server/http_server.py`): one WebSocket per session, each with
its own environment object on the server; JSON text frames `{"type": "reset" | "step" | "state" | "close",
"data": ...}` answered by `{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`,
`{"type": "state", "data": {...}}` or `{"type": "error", "data": {"message": ..., "code": ...}}`.

- Start: `GET /health` and `GET /schema` must answer within environment.step_timeout, else one line naming the
  URL. The schema's Action becomes the model's tool, as for an in-process OpenEnv class (openenv.py: ActionCodec,
  the observation's text, the summed reward: the same for both kinds).
- Sessions (`OpenEnvSessions`): each rank keeps up to environment.concurrency sessions open and reuses them from
  episode to episode (the server's `reset` re-initialises its environment; exactness across resumes rests on the
  server honouring `reset(seed=)`, OpenEnv's contract). They are opened together when the first episode is made,
  so the server's capacity is known before any episode plays: OpenEnv serves one session per server unless started with
  `max_concurrent_envs`, and refuses the next with `CAPACITY_REACHED`. That refusal is reported as such, once,
  with the server's numbers, and the rank runs as many episodes at once as it holds sessions (`capacity`).
- Model-side mistakes (an action the server's Action rejects: `VALIDATION_ERROR`) are told to the model. The
  server's own errors (`EXECUTION_ERROR`: its environment raised), a reply that does not come within
  environment.step_timeout (`StepTimeout`) and a dropped connection (`Disconnected`) end the episode as failures;
  after a timeout or a drop the session is closed, never reused (a late reply would answer the next request, as
  OpenEnv's own client notes), and a new one is opened for a later episode. A frame over
  environment.max_message_mb closes the connection (websockets' own limit, 1 MiB by default, is raised to it).
- A server that went away is reconnected with backoff (0.5 s doubling, at most 8 s): episodes that cannot get a
  session meanwhile fail as disconnected; once it has been unreachable for environment.reconnect_timeout the
  run stops (`EnvironmentServerLost`, one line naming the URL).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, TrainingError
from .openenv import (
    RESERVED_FIELDS,
    ActionCodec,
    ObservationText,
    Observed,
    OpenEnvTurns,
    check_observation,
    format_validation_errors,
)
from .protocol import EpisodeSpec, ProtocolBreach

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger("grpo_trainer")

BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0  # seconds between attempts to reach a server that went away
# A reply is waited for this much longer than environment.step_timeout: the loop's own limit on the call (which
# names the limit and marks the episode timed out) always fires first; ours only ends the wait and frees the
# session, which a hung server would otherwise hold for as long as its step hangs.
REPLY_GRACE = 1.0


class EnvironmentServerLost(TrainingError):
    """The OpenEnv server went away and did not come back within environment.reconnect_timeout: the run stops."""


class ServerError(RuntimeError):
    """The server answered with an error of its own (its environment raised, the session failed): a failure."""


class StepTimeout(TimeoutError):
    """No reply within environment.step_timeout (and REPLY_GRACE); the session is dropped (a failure: timeout)."""


class Disconnected(ConnectionError):
    """The connection dropped, or no session could be opened (a failure: disconnect)."""


class CapacityReached(ConnectionError):
    """The server refused a new session: it serves no more at once (`CAPACITY_REACHED`)."""


def endpoints(url: str) -> tuple[str, str]:
    """`openenv+ws://HOST:PORT` -> (`ws://HOST:PORT/ws`, `http://HOST:PORT`); `openenv+wss` -> wss / https."""
    scheme, _, rest = url.partition("://")
    rest = rest.rstrip("/")
    secure = scheme == "openenv+wss"
    return f"{'wss' if secure else 'ws'}://{rest}/ws", f"{'https' if secure else 'http'}://{rest}"


def fetch_schema(url: str, timeout: float) -> dict[str, Any]:
    """`GET /health` then `GET /schema`: the server's Action/Observation schemas; ConfigError (one line) if no
    OpenEnv server answers."""
    _, http = endpoints(url)
    answers = {}
    for path in ("/health", "/schema"):
        try:
            with urllib.request.urlopen(http + path, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise ConfigError(
                f"environment.url {url}: GET {http}{path} answered {exc.code} {exc.reason}; is it an OpenEnv server?"
            ) from None
        except (OSError, ValueError) as exc:  # refused, timed out, unresolvable
            reason = getattr(exc, "reason", None) or exc
            raise ConfigError(
                f"environment.url {url}: no OpenEnv server answers (GET {http}{path}: {reason})"
            ) from None
        try:
            answers[path] = json.loads(body)
        except ValueError:  # something answers, but not an OpenEnv server (a web page, another API)
            raise ConfigError(
                f"environment.url {url}: GET {http}{path} answered, but not with JSON ({_start(body)}); "
                "is it an OpenEnv server?"
            ) from None
    schema = answers["/schema"]
    if not (
        isinstance(schema, dict)
        and isinstance(schema.get("action"), dict)
        and isinstance(schema.get("observation"), dict)
    ):
        raise ConfigError(f"environment.url {url}: GET {http}/schema gave no OpenEnv action and observation schemas")
    return schema


def _start(body: bytes) -> str:
    """The first characters of an answer, for a message."""
    text = body[:60].decode("utf-8", "replace")
    return repr(text + ("..." if len(body) > 60 else ""))


class Session:
    """One `/ws` connection: one environment object on the server."""

    def __init__(self, ws_url: str, open_timeout: float, max_size: int):
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()  # websockets >= 17.1 wants connect() used as a context manager
        self.ws = self._stack.enter_context(connect(ws_url, open_timeout=open_timeout, max_size=max_size))

    def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one message and read its answer. A refused session sends its error frame and closes, possibly
        before our message goes out: that frame is read either way."""
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps(message))
        except ConnectionClosed:
            pass  # the reply to read is the frame the server queued before closing
        try:
            frame = self.ws.recv(timeout=timeout)
        except TimeoutError:
            raise StepTimeout(f"no answer to {message['type']} within {timeout:g} s") from None
        reply = json.loads(frame)
        if not isinstance(reply, dict) or not isinstance(reply.get("data", {}), dict):
            raise ProtocolBreach(f"the server answered {message['type']} with {frame[:80]!r}")
        return reply

    def stray(self) -> str | bytes | None:
        """A frame already waiting before a request is sent (None when there is none): a server that sent more than
        one answer to a request. Raises ConnectionClosed when the connection closed meanwhile."""
        try:
            return self.ws.recv(timeout=0)
        except TimeoutError:
            return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()


# What each request may be answered with: anything else is a breach of the protocol, and the session is closed (a
# reply out of step would otherwise answer the session's next request, in this episode or a later one).
ANSWERS = {"reset": ("observation", "error"), "step": ("observation", "error"), "state": ("state", "error")}


@dataclass
class RemoteSnapshot:
    """What reward functions receive for a remote episode in `environments`: the server's state (its `state`
    message) and the episode's last observation."""

    state: dict[str, Any] | None
    reward: float | None  # the episode's summed reward
    done: bool
    observation: dict[str, Any] | None


class OpenEnvSessions:
    """A rank's pool of sessions to one server: all opened at once (to learn the server's capacity), lent to one
    episode at a time, replaced when one fails, reconnected with backoff when the server goes away."""

    def __init__(
        self, url: str, *, sessions: int, step_timeout: float, reconnect_timeout: float, max_message_mb: float
    ):
        self.url = url
        self.ws_url, _ = endpoints(url)
        self.wanted = sessions
        self.step_timeout = step_timeout
        self.reply_timeout = step_timeout + REPLY_GRACE
        self.reconnect_timeout = reconnect_timeout
        self.max_size = int(max_message_mb * 2**20)
        self._changed = threading.Condition()
        self._free: list[Session] = []
        self._open = 0  # sessions lent or free, and sessions being opened
        self.capacity = sessions  # at most this many open: lowered when the server refuses one
        self._down_since: float | None = None  # when the server was first found unreachable
        self._dropped = False  # a connection dropped since the last session opened
        self.capacity_refusals = 0
        self.reconnects = 0  # sessions opened again after the server dropped or was unreachable
        self.disconnects = 0
        for _ in range(sessions):
            try:
                session = self._connect()
            except CapacityReached as exc:
                if not self._open:
                    raise Disconnected(f"it refused every session ({exc}): another client holds them") from None
                self._refused(exc)
                break
            with self._changed:
                self._open += 1
                self._free.append(session)

    def _connect(self) -> Session:
        """A new session, probed with a `state` message: a refused one answers CAPACITY_REACHED and closes."""
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        try:
            session = Session(self.ws_url, self.step_timeout, self.max_size)
        except (OSError, InvalidHandshake) as exc:
            raise Disconnected(f"{self.url}: {type(exc).__name__}: {exc}") from None
        try:
            reply = session.request({"type": "state"}, self.reply_timeout)
        except (ConnectionClosed, StepTimeout) as exc:
            session.close()
            raise Disconnected(f"{self.url}: {type(exc).__name__}: {exc}") from None
        except BaseException:
            session.close()
            raise
        if reply.get("type") == "error":
            session.close()
            data = reply.get("data", {})
            if data.get("code") == "CAPACITY_REACHED":
                raise CapacityReached(data.get("message", "server at capacity"))
            raise ServerError(f"{self.url} refused a session: {data.get('message')} ({data.get('code')})")
        return session

    def _refused(self, exc: CapacityReached) -> None:
        with self._changed:
            self.capacity_refusals += 1
            first = self.capacity == self.wanted
            self.capacity = self._open
            self._changed.notify_all()
        if first:
            logger.warning(
                "%s accepts %d session%s (%s); running %d episode%s at a time on this rank (environment.concurrency "
                "%d): start the server with max_concurrent_envs >= %d x the number of ranks",
                self.url,
                self._open,
                "" if self._open == 1 else "s",
                exc,
                self.capacity,
                "" if self.capacity == 1 else "s",
                self.wanted,
                self.wanted,
            )

    def acquire(self, timeout: float) -> Session:
        """A session for one episode: a free one, else a new one (within the capacity), else the next one freed.
        Disconnected when none can be had within `timeout` s; EnvironmentServerLost once the server has been
        unreachable for reconnect_timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._free and self._open >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Disconnected(f"{self.url}: no session free within {timeout:g} s (capacity {self.capacity})")
                self._changed.wait(left)
            if self._free:
                return self._free.pop()
            self._open += 1  # a slot for the session about to be opened
        try:
            return self._reopen(deadline)
        except BaseException:
            with self._changed:
                self._open -= 1
                self._changed.notify_all()
            raise

    def _reopen(self, deadline: float) -> Session:
        """A new session, with backoff while the server is away (until `deadline`, or the run-level limit)."""
        delay = BACKOFF_FIRST
        while True:
            try:
                session = self._connect()
            except CapacityReached as exc:  # e.g. a hung step on the server still holds a dropped session's slot
                with self._changed:
                    self.capacity_refusals += 1
                failure: Exception = exc
            except Disconnected as exc:
                now = time.monotonic()
                with self._changed:
                    self._down_since = self._down_since or now
                    down = now - self._down_since
                if down >= self.reconnect_timeout:
                    raise EnvironmentServerLost(
                        f"{self.url} went away and did not come back within {self.reconnect_timeout:g} s "
                        f"(environment.reconnect_timeout); stopping"
                    ) from None
                failure = exc
            else:
                with self._changed:
                    if self._down_since is not None or self._dropped:
                        self.reconnects += 1
                        self._down_since, self._dropped = None, False
                return session
            if time.monotonic() + delay > deadline:
                raise Disconnected(f"{failure}") from None
            time.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    def release(self, session: Session) -> None:
        """A session back to the pool after an episode that ended cleanly."""
        with self._changed:
            self._free.append(session)
            self._changed.notify_all()

    def discard(self, session: Session, disconnected: bool = False) -> None:
        """A session that must not be used again (a timeout: a late reply; a drop): closed, its slot freed."""
        session.close()
        with self._changed:
            self._open -= 1
            self.disconnects += disconnected
            self._dropped = self._dropped or disconnected
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            free, self._free = self._free, []
            self._open -= len(free)
        for session in free:
            with contextlib.suppress(Exception):
                session.ws.send(json.dumps({"type": "close"}))
            session.close()


class RemoteEpisode(OpenEnvTurns):
    """One episode on a session of the pool (the `Episode` protocol)."""

    def __init__(self, env: OpenEnvRemote):
        super().__init__(env)
        self._held: list[Session] = []  # this episode's session, while it has one
        # The loop never touches an episode again after one of its calls timed out (not even close()): its session,
        # should that call still get it, goes back when the episode is dropped, so the pool does not shrink.
        weakref.finalize(self, _discard_all, env.pool, self._held)
        self.last: Observed | None = None

    @property
    def session(self) -> Session | None:
        return self._held[0] if self._held else None

    def reset(self, spec: EpisodeSpec, j: int) -> str | None:
        pool = self.env.pool
        data = {k: v for k, v in spec.record.items() if _jsonable(v)}  # the server passes what reset's signature takes
        data.update(seed=spec.seed, episode_id=f"{spec.episode_id}-g{j}")
        # A free session may have died while it waited (the server was restarted between batches), or be out of step
        # (a stray frame): nothing of the episode has happened yet, so another session is tried, at most once per
        # session the pool can hold.
        for attempt in range(pool.wanted + 1):
            self._held.append(pool.acquire(timeout=pool.step_timeout))
            try:
                reply = self._request({"type": "reset", "data": data})
                break
            except (Disconnected, ProtocolBreach):  # a session out of step was closed: another one
                if attempt == pool.wanted:
                    raise
        observed = self._observation(reply, "reset")
        self.done = observed.done
        return self.env.text.render(observed, self.env.reset_schema, "the server's reset") or None

    def _step(self, payload: dict[str, Any]) -> tuple[Observed, str] | str:
        reply = self._request({"type": "step", "data": payload})
        if reply.get("type") == "error" and reply["data"].get("code") == "VALIDATION_ERROR":
            return format_validation_errors(reply["data"].get("errors") or [reply["data"]])
        observed = self._observation(reply, "step")
        return observed, self.env.text.render(observed, self.env.schema["observation"], "the server's step")

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request on this episode's session; a session that timed out or dropped is discarded first."""
        from websockets.exceptions import ConnectionClosed

        pool, session = self.env.pool, self.session
        if session is None:
            raise Disconnected(f"{pool.url}: this episode's session was lost")
        kind = message["type"]
        try:
            stray = session.stray()
            if stray is not None:
                raise ProtocolBreach(f"{pool.url} sent a frame nobody asked for before {kind}: {stray[:80]!r}")
            reply = session.request(message, pool.reply_timeout)
            if reply.get("type") not in ANSWERS.get(kind, (reply.get("type"),)):
                raise ProtocolBreach(f"{pool.url} answered {kind} with a {reply.get('type')!r} message")
            return reply
        except ProtocolBreach as exc:  # the session is out of step with its server: closed, never lent again
            self._drop()
            raise ProtocolBreach(f"{exc}; the session is closed") from None
        except StepTimeout:
            self._drop()
            raise
        except ConnectionClosed as exc:
            too_big = exc.sent is not None and exc.sent.code == 1009  # we closed it: over our max_size
            self._drop(disconnected=not too_big)
            if too_big:
                raise ServerError(
                    f"{pool.url} sent a message larger than {pool.max_size / 2**20:g} MiB (environment.max_message_mb)"
                ) from None
            raise Disconnected(f"{pool.url} closed the connection ({exc})") from None

    def _drop(self, disconnected: bool = False) -> None:
        if self._held:
            self.env.pool.discard(self._held.pop(), disconnected)

    def _observation(self, reply: dict[str, Any], what: str) -> Observed:
        data = reply.get("data", {})
        if reply.get("type") == "error":
            self._drop()  # the server's environment is in whatever state its error left it: not reused
            raise ServerError(f"{self.env.pool.url} {what}: {data.get('message')} ({data.get('code')})")
        if reply.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise ProtocolBreach(
                f"{self.env.pool.url} answered {what} with a {reply.get('type')!r} message, not an observation"
            )
        self.last = check_observation(data["observation"], data.get("done"), data.get("reward"), f"the server's {what}")
        return self.last

    def snapshot(self) -> RemoteSnapshot:
        state = None
        if self.session is not None:
            reply = self._request({"type": "state"})
            state = reply.get("data") if reply.get("type") == "state" else None
        return RemoteSnapshot(state, self.rewards.total, self.done, None if self.last is None else self.last.fields)

    def close(self) -> None:
        if self._held:
            self.env.pool.release(self._held.pop())


def _discard_all(pool: OpenEnvSessions, held: list[Session]) -> None:
    while held:
        pool.discard(held.pop())


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class OpenEnvRemote:
    """`environment.url`: the server, its schemas and this rank's sessions (the `Environment` protocol)."""

    has_reward = True

    def __init__(
        self,
        url: str,
        *,
        sessions: int,
        step_timeout: float,
        reconnect_timeout: float,
        max_message_mb: float,
        action_tool: str | None = None,
        observation_field: str | None = None,
    ):
        try:
            import websockets.sync.client  # noqa: F401
        except ImportError:
            raise ConfigError("environment.url needs the websockets package: pip install 'grpo-trainer[env]'") from None
        self.url = url
        self.name = f"environment.url {url}"
        self.schema = fetch_schema(url, step_timeout)
        self.reset_schema = self.schema.get("reset_observation") or self.schema["observation"]
        self.codec = ActionCodec(self.schema["action"], action_tool)
        self.tools = [self.codec.tool]
        self.text = ObservationText(observation_field)
        shown = [k for k in self.schema["observation"].get("properties", {}) if k not in RESERVED_FIELDS]
        if observation_field is not None and observation_field not in shown:
            raise ConfigError(
                f"environment.observation_field {observation_field!r}: the observation of {url} has no such "
                f"field ({', '.join(shown)})"
            )
        self._pool_options: dict[str, Any] = dict(
            sessions=sessions,
            step_timeout=step_timeout,
            reconnect_timeout=reconnect_timeout,
            max_message_mb=max_message_mb,
        )
        self._pool: OpenEnvSessions | None = None
        self._opening = threading.Lock()

    @property
    def pool(self) -> OpenEnvSessions:
        """This rank's sessions, opened when an episode first needs them: a run builds its environment once and
        plays it, but the `kernels` command builds one only for its tool schema, and holds no server sessions."""
        with self._opening:
            if self._pool is None:
                try:
                    self._pool = OpenEnvSessions(self.url, **self._pool_options)
                except (Disconnected, ServerError) as exc:
                    raise ConfigError(f"{self.name}: cannot open a session: {exc}") from None
            return self._pool

    @property
    def capacity(self) -> int:
        """Episodes this rank can run at once: its sessions (environment.concurrency, or what the server took)."""
        return self.pool.capacity

    def counters(self) -> dict[str, int]:
        """The pool's capacity refusals and reconnects (0 before it is opened: its opening's refusals count)."""
        pool = self._pool
        return {
            "capacity_refusals": pool.capacity_refusals if pool else 0,
            "reconnects": pool.reconnects if pool else 0,
        }

    def episode(self) -> RemoteEpisode:
        return RemoteEpisode(self)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def build(cfg: Config) -> OpenEnvRemote:
    env = cfg.environment
    assert env.url is not None, "built for environment.url only (environments.build_environment)"
    return OpenEnvRemote(
        env.url,
        sessions=env.concurrency,
        step_timeout=env.step_timeout,
        reconnect_timeout=env.reconnect_timeout,
        max_message_mb=env.max_message_mb,
        action_tool=env.action_tool,
        observation_field=env.observation_field,
    )
