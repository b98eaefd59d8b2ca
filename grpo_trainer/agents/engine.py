"""Agent programs as a rollout engine: each completion of a step is one episode a `Player` plays against the token
endpoint (producer.py is the seam; docs/agents.md).

`AgentEngine` wraps the run's engine as `EpisodeEngine` (environments/episodes.py) does (`EngineWrapper`: pushes and
closing reach the wrapped engine, and its capabilities are the wrapped engine's): its own `generate` takes
`episodes=` (`TakesEpisodes`). Per rank it owns:

- one `TokenEndpoint` (endpoint.py) over the wrapped engine, started at the first `generate` and closed with the
  engine: the hf engine through `HFTokenSampler` (`sample_rows`, sampler log-probs computed for its requests), any
  other through `EngineTokenSampler` (its `generate`, which reports sampler log-probs: vllm_colocate, vllm_server);
- one players' loop: an asyncio loop on a daemon thread, where the player's `serving()` is entered once and every
  `play` runs, at most `environment.concurrency` at once.

`generate(prompt_ids, G, episodes=specs)`: for slot j of prompt i, one endpoint episode (budget: the call's length
limit, rollout.max_completion_length), played with `play(row, handle, seed)`, then closed. Each request's seed is
the endpoint's `mix_seed(run seed, group, j, turn)`, the group being the group's environment seed (itself from the
run seed, step, draw and position in the batch: `EpisodeSpec.seed`): never arrival order or concurrency, so a
deterministic agent gives the same tokens on a resumed run. The episode becomes one completion: its last branch
(the one that ended the episode and that the reward judged), prompt = the branch's first prompt, completion = the
rest, `completion_mask` 1 on sampled tokens, `sampling_logprobs` aligned (0 where masked), an
`AgentEpisodeRecord` for the rewards and metrics, the episode's messages for the reward functions. Its earlier
branches (a re-rendered conversation, a second one) go with it (`Rollout.branches`): each a training row of its own
with the episode's advantage (samples.TrainingSamples.branch_of), so everything the policy sampled is trained once.

Failure (each ends only its episode, scored by environment.on_error, one log line per kind per batch):
- `play` raises (sys.exit included), returns something else than `Played`, or says `ok=False`: `error`;
- `os._exit` in it (under deadline.guard_os_exit, entered here where the CLI has not): `error`;
- its own time (wall time minus the time its requests spent in the endpoint) passes environment.episode_timeout: its
  task is cancelled, `timeout`; a sync solve function past it is abandoned (deadline.UserCalls, `call_sync`);
- an async player that blocks the players' loop itself (sync code that never yields) past every deadline by
  `LOOP_GRACE` seconds: the loop is abandoned with its episodes (timeouts) and a new one made for the next batch;
- floods, malformed or unauthenticated requests, asking beyond the budget: the endpoint refuses them (counted);
  what the program makes of the refusal is its episode's outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ..deadline import Call, CallsHang, Outcome, UserCalls, guard_os_exit, one_line, raise_on_os_exit
from ..environments.protocol import (
    ENDED_BY_ENVIRONMENT,
    ENDED_BY_LENGTH,
    FAILED_ERROR,
    FAILED_TIMEOUT,
    EpisodeRecord,
    EpisodeSpec,
    reward_number,
)
from ..environments.scoring import failure_summary
from ..errors import UserError
from ..rollout import (
    Branch,
    EngineWrapper,
    Rollout,
    RolloutEngine,
    SamplesTrainingModel,
    TakesEpisodes,
    capability,
    lockstep_of,
)
from ..seeds import mix_seed
from .endpoint import EpisodeHandle, TokenEndpoint
from .producer import Played, Player, PlayerEnvironment
from .records import EpisodeRequests
from .sampler import EngineTokenSampler, HFTokenSampler, TokenSampler

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger("grpo_trainer")

DEFAULT_CONTEXT = 4096  # the context the endpoint assumes for a vLLM engine without rollout.vllm.max_model_len
LOOP_GRACE = 10.0  # seconds past every running episode's deadline before the players' loop counts as blocked
ABANDONED_PER_WORKER = 4  # sync solve calls still running past their deadline, per slot, before the run stops


@dataclass
class AgentEpisodeRecord(EpisodeRecord):
    """An agent's episode, for the rewards (`episodes=`) and the metrics: the environment's record and what the
    endpoint and the player saw."""

    stop_condition: str | None = None  # the player's words (Played.stop_condition)
    rewards: dict[str, float] | None = None  # named rewards (environment/<name>), when the player gave a dict
    requests: int = 0  # requests served
    refused: dict[str, int] = field(default_factory=dict)  # requests refused, by error code
    completion_tokens: int = 0  # sampled in all its branches
    branches: int = 0
    rerendered_turns: int = 0
    sampler_seconds: float = 0.0  # time its requests spent in the endpoint
    agent_seconds: float = 0.0  # its own time: wall time minus sampler time (what episode_timeout bounds)
    counters: dict[str, float] = field(default_factory=dict)  # Played.counters


@dataclass
class _Places:
    """The slots of one batch that wait for a place and have not been promised one yet (players' loop only). A
    place is promised when an episode ends, in the same call that tells the endpoint (`play_ended`): counting the
    slots that have *started* instead would promise one waiting slot twice when two episodes end before it starts."""

    unpromised: int

    def promise(self) -> bool:
        if self.unpromised <= 0:
            return False
        self.unpromised -= 1
        return True


@dataclass(frozen=True)
class _Deadline:
    """The running episode's limit, for sync code it calls (`call_sync`)."""

    limit: float
    excluded: Callable[[], float]
    calls: UserCalls
    waiters: concurrent.futures.ThreadPoolExecutor  # threads that wait on `calls` for the loop


_DEADLINE: contextvars.ContextVar[_Deadline | None] = contextvars.ContextVar("agent_episode_deadline", default=None)


class EpisodeTimeout(Exception):
    """A sync call of an episode ran past environment.episode_timeout (abandoned)."""


async def call_sync(fn: Callable[[], Any]) -> Any:
    """`fn()` for the running episode, in a daemon thread of deadline.UserCalls, within what is left of the episode's
    limit (its requests' time in the endpoint not counted): its value, or what it raised (SystemExit and os._exit
    included: `OsExitCalled`), or EpisodeTimeout. How a player runs blocking code (the solve player's sync solve)."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return await asyncio.to_thread(fn)
    call = Call(fn, deadline.limit, excluded=deadline.excluded, label="episode")
    loop = asyncio.get_running_loop()
    outcome = (await loop.run_in_executor(deadline.waiters, deadline.calls.run, [call]))[0]
    if outcome.timed_out is not None:
        raise EpisodeTimeout("the agent ran past environment.episode_timeout")
    if outcome.exception is not None:
        raise outcome.exception
    return outcome.value


@dataclass
class _Slot:
    """One episode of a batch."""

    prompt: int  # index into the call's prompts
    j: int  # its position in the group
    row: dict[str, Any]
    seed: int
    handle: EpisodeHandle
    started: float | None = None  # when it got a place among the concurrent plays
    finished: float | None = None
    outcome: Outcome | None = None
    timed_out: bool = False


class _PlayersLoop:
    """An asyncio loop on a daemon thread: the player's `serving()` entered on it once, every play run on it."""

    def __init__(self, player: Player, concurrency: int):
        self.player = player
        self.loop = asyncio.new_event_loop()
        # asyncio.to_thread in the agents' code: as many threads as plays run at once
        self.executor = concurrent.futures.ThreadPoolExecutor(concurrency, "agent-to-thread")
        self.loop.set_default_executor(self.executor)
        self._exit: contextlib.AsyncExitStack | None = None
        self.thread = threading.Thread(target=self._run, name="agent-players", daemon=True)
        self.thread.start()
        try:
            self.submit(self._enter()).result()
        except Exception as exc:  # the player's own setup: the run cannot play it (one line)
            self.close(leave=False)
            raise UserError(f"{player.name}: serving() failed: {one_line(exc)}") from None
        self.semaphore = self.submit(self._semaphore(concurrency)).result()

    def _run(self) -> None:
        raise_on_os_exit()  # os._exit in a play ends its episode, not the run
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            if not self.abandoned:
                self.loop.close()

    abandoned = False  # given up on while blocked: its tasks are left as they are

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def _semaphore(self, n: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(n)

    async def _enter(self) -> None:
        serving = getattr(self.player, "serving", None)
        if serving is not None:
            self._exit = contextlib.AsyncExitStack()
            await self._exit.enter_async_context(serving())

    async def _leave(self) -> None:
        if self._exit is not None:
            await self._exit.aclose()

    def close(self, leave: bool = True) -> None:
        """Leave `serving()` and stop the loop (`leave=False`: a blocked loop, abandoned as it is)."""
        if leave and self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.submit(self._leave()).result(timeout=60)
        self.abandoned = not leave
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.executor.shutdown(wait=False)


class AgentEngine(EngineWrapper, TakesEpisodes):
    """An engine whose completions are episodes of agent programs; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        environment: PlayerEnvironment,
        tokenizer,
        *,
        seed: int,
        eos_token_ids: list[int],
        max_completion_length: int,
        max_model_len: int | None,
        episode_timeout: float,
        concurrency: int,
        rounds: bool = False,
        vocab_size: int | None = None,
    ):
        super().__init__(engine)
        self.environment = environment
        self.player = environment.player
        self.tokenizer = tokenizer
        self.seed = seed
        self.eos_token_ids = list(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.max_model_len = max_model_len
        self.episode_timeout = episode_timeout
        self.concurrency = concurrency
        self.rounds = rounds  # the endpoint batches in rounds (rollout.seed_per_prompt: endpoint.py says why)
        self.vocab_size = vocab_size  # a vLLM engine's policy rows (the hf engine's are read from its model)
        self.counter_names: tuple[str, ...] = tuple(getattr(self.player, "counter_names", ()) or ())
        self.stop_names = stop_names(self.player)
        self.calls = UserCalls(
            self.player.name,
            concurrency,
            ABANDONED_PER_WORKER * concurrency,
            "environment.episode_timeout",
            what="the agent hangs",
            catch_os_exit=True,
        )
        self.waiters = concurrent.futures.ThreadPoolExecutor(concurrency, "agent-sync-wait")
        self.loop_grace = LOOP_GRACE
        self.endpoint: TokenEndpoint | None = None
        self._players: _PlayersLoop | None = None
        # os._exit raises in the agents' threads while the engine lives (a no-op under the CLI's own guard): an
        # abandoned sync solve may still call it after its batch
        self._guard = contextlib.ExitStack()

    @property
    def needs_episodes(self) -> bool:
        """Always: an agent plays from the dataset row (`episodes=`, one EpisodeSpec per prompt)."""
        return True

    def close(self) -> None:
        """The players' loop (leaving the player's `serving()`), the endpoint, the sync calls' threads, and the
        wrapped engine."""
        if self._players is not None:
            self._players.close()
            self._players = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.calls.close()
        self.waiters.shutdown(wait=False)
        self._guard.close()
        super().close()

    # ------------------------------------------------------------------ serving
    def _sampler(self) -> TokenSampler:
        if hasattr(self.inner, "sample_rows"):  # the hf engine: one decode, each row its own stream
            return HFTokenSampler(cast(Any, self.inner), self.max_model_len)  # None: the model's context
        return EngineTokenSampler(
            self.inner, self.eos_token_ids, self.max_model_len or DEFAULT_CONTEXT, vocab_size=self.vocab_size
        )

    def _start(self) -> TokenEndpoint:
        if self.endpoint is None:
            self.endpoint = TokenEndpoint(
                self._sampler(), self.tokenizer, seed=self.seed, eos_token_ids=self.eos_token_ids, rounds=self.rounds
            ).start()
        if self._players is None:
            self._guard.enter_context(guard_os_exit())
            self._players = _PlayersLoop(self.player, self.concurrency)
        return self.endpoint

    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[Any] | None = None,
    ) -> Rollout:
        """G episodes per prompt, each one row (see the module docstring). `seeds` are not needed: every request
        is seeded by the endpoint from the group's `EpisodeSpec.seed`, with rollout.seed_per_prompt or without."""
        if episodes is None:
            raise ValueError(f"{self.player.name}: episodes need their dataset rows and seeds (episodes=)")
        g = num_generations
        budget = min(max_tokens, self.max_completion_length) if max_tokens else self.max_completion_length
        endpoint = self._start()
        specs: list[EpisodeSpec] = episodes
        slots = []
        for i, spec in enumerate(specs):
            for j in range(g):
                handle = endpoint.open_episode(
                    step=spec.seed, index=j, budget=budget, session_id=f"{spec.episode_id}-g{j}"
                )
                slots.append(_Slot(i, j, spec.record, mix_seed(spec.seed, j), handle))
        tick = time.perf_counter()
        self._play(slots)
        requests = [endpoint.close_episode(s.handle.session_id) for s in slots]
        rollout = self._rollout(prompt_ids, specs, g, slots, requests)
        rollout.env_seconds = time.perf_counter() - tick
        for line in failure_summary(self.player.name, rollout.episodes or []):
            logger.warning("%s", line)
        return rollout

    def _play(self, slots: list[_Slot]) -> None:
        """Every slot played on the players' loop; returns when all have an outcome (or the loop is blocked)."""
        assert self._players is not None and self.endpoint is not None
        players = self._players
        places = _Places(max(len(slots) - self.concurrency, 0))
        self.endpoint.expect_players(min(len(slots), self.concurrency))
        futures = {players.submit(self._episode(slot, players.semaphore, places)): slot for slot in slots}
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=1.0)
            for future in done:
                if future.exception() is not None:  # CallsHang: the run stops
                    raise cast(BaseException, future.exception())
            if pending and self._blocked([futures[f] for f in pending]):
                logger.warning(
                    "%s: the players' event loop has been blocked for over %g s past every deadline (sync code in "
                    "an async agent); its %d episodes fail as timeouts and a new loop is started",
                    self.player.name,
                    self.loop_grace,
                    len(pending),
                )
                for future in pending:
                    slot = futures[future]
                    slot.outcome, slot.timed_out = Outcome(timed_out="episode"), True
                players.close(leave=False)
                self._players = None
                return

    def _blocked(self, slots: list[_Slot]) -> bool:
        """Whether every slot still running is past its deadline by `loop_grace` (the loop would have ended them)."""
        assert self.endpoint is not None
        now = time.perf_counter()
        running = [s for s in slots if s.started is not None]
        if not running:
            return False
        for slot in running:
            used = now - cast(float, slot.started) - self.endpoint.sampler_seconds(slot.handle.session_id)
            if used < self.episode_timeout + self.loop_grace:
                return False
        return True

    async def _episode(self, slot: _Slot, semaphore: asyncio.Semaphore, places: _Places) -> None:
        """One play within its deadline, its outcome set on the slot (never raises but CallsHang)."""
        assert self.endpoint is not None
        endpoint = self.endpoint
        async with semaphore:
            slot.started = time.perf_counter()
            started = slot.started
            session = slot.handle.session_id
            endpoint.play_started(session)

            def excluded() -> float:
                return endpoint.sampler_seconds(session)

            _DEADLINE.set(_Deadline(self.episode_timeout, excluded, self.calls, self.waiters))
            task = asyncio.ensure_future(self._guarded(slot))
            try:
                while True:
                    left = self.episode_timeout - (time.perf_counter() - started - excluded())
                    if left <= 0:
                        task.cancel()
                        slot.outcome, slot.timed_out = Outcome(timed_out="episode"), True
                        with contextlib.suppress(BaseException):
                            await asyncio.wait({task}, timeout=1.0)
                        return
                    done, _ = await asyncio.wait({task}, timeout=left)
                    if done:
                        slot.outcome = task.result()
                        return
            finally:
                slot.finished = time.perf_counter()
                endpoint.play_ended(session, successor=places.promise())  # a waiting slot takes its place

    async def _guarded(self, slot: _Slot) -> Outcome:
        """The play's outcome: Played, or what it raised (SystemExit and os._exit too), as deadline.Outcome."""
        try:
            played = await self.player.play(copy.deepcopy(slot.row), slot.handle, slot.seed)
        except CallsHang:
            raise
        except EpisodeTimeout as exc:
            return Outcome(timed_out="episode", exception=exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (the agent's code: whatever it raises ends its episode)
            return Outcome(error=one_line(exc), exception=exc)
        if not isinstance(played, Played):
            return Outcome(error=f"play returned {type(played).__name__}, not Played")
        return Outcome(value=played)

    # ------------------------------------------------------------------ episodes to rows
    def _rollout(
        self,
        prompt_ids: list[list[int]],
        specs: list[EpisodeSpec],
        g: int,
        slots: list[_Slot],
        requests: list[EpisodeRequests],
    ) -> Rollout:
        completion_ids, masks, logprobs, prompts, truncated, messages, records = [], [], [], [], [], [], []
        earlier: list[list[Branch]] = []  # per episode, its branches before the last: rows of their own
        for slot, req in zip(slots, requests):
            req.api_key = ""  # the episode is closed: its key is worth nothing, and is not carried further
            played = slot.outcome.value if slot.outcome is not None and slot.outcome.ok else None
            branches = played.branches if played is not None and played.branches is not None else req.branches()
            record = self._record(slot, req, played, specs[slot.prompt].episode_id)
            record.branches = len(branches)
            record.completion_tokens = sum(sum(b.completion_mask) for b in branches)
            earlier.append(list(branches[:-1]))
            if branches:
                last = branches[-1]  # the branch that ended the episode, which the reward judged
                prompts.append(list(last.prompt_ids))
                completion_ids.append(list(last.completion_ids))
                masks.append(list(last.completion_mask))
                logprobs.append(list(last.logprobs))
                truncated.append(last.truncated)
            else:  # nothing sampled (it failed first): a placeholder the loss never sees
                prompts.append(list(prompt_ids[slot.prompt]))
                completion_ids.append(self.eos_token_ids[:1])
                masks.append([0])
                logprobs.append([0.0])
                truncated.append(False)
            messages.append(self._messages(played, req, completion_ids[-1]))
            records.append(record)
        n = len(slots)
        rollout = Rollout(
            completion_ids=completion_ids,
            truncated=truncated,
            sampling_logprobs=logprobs,
            completion_mask=masks,
            conversations=messages,
            tool_calls=[0] * n,
            tool_errors=[0] * n,
            turns=[r.turns for r in records],
            prompt_ids=prompts,
            episodes=records,
            branches=earlier,
        )
        rollout.env_counters = cast(dict[str, int], self._counters(records))  # floats too: summed as floats
        return rollout

    def _record(self, slot: _Slot, req: EpisodeRequests, played: Played | None, group: str) -> AgentEpisodeRecord:
        outcome = slot.outcome or Outcome(error="the episode was never played")
        sampler = req.sampler_seconds
        record = AgentEpisodeRecord(
            ended_by=ENDED_BY_ENVIRONMENT,
            turns=len(req.turns),
            group=group,
            requests=len(req.turns),
            refused=dict(req.refused),
            rerendered_turns=req.rerendered_turns,
            sampler_seconds=sampler,
            agent_seconds=max(0.0, slot.finished - slot.started - sampler) if slot.finished and slot.started else 0.0,
        )
        if slot.timed_out or outcome.timed_out is not None:
            record.ended_by = FAILED_TIMEOUT
            record.error = (
                f"the agent ran past environment.episode_timeout ({self.episode_timeout:g} s of its own time)"
            )
            return record
        if played is None:
            record.ended_by, record.error = FAILED_ERROR, f"the agent: {outcome.error}"  # kinds: the exception's type
            return record
        record.stop_condition = played.stop_condition
        record.counters = dict(played.counters)
        if not played.ok:
            record.ended_by, record.error = FAILED_ERROR, f"the agent failed: {played.error or 'no reason given'}"
            return record
        try:
            self._take_reward(record, played.reward)
        except ValueError as exc:
            record.ended_by, record.error = FAILED_ERROR, f"the agent's reward: {exc}"
            return record
        if req.tokens_used >= req.budget or req.refused.get("budget_exhausted"):
            record.ended_by = ENDED_BY_LENGTH
        return record

    def _take_reward(self, record: AgentEpisodeRecord, reward: Any) -> None:
        names = self.environment.reward_names
        if isinstance(reward, Mapping):
            if not names:
                raise ValueError(
                    f"a dict ({', '.join(map(str, reward))}): declare its names and weights in environment.reward_weights"
                )
            unknown = [k for k in reward if k not in names]
            if unknown:
                raise ValueError(f"{', '.join(map(str, unknown))} not in environment.reward_weights")
            record.rewards = {k: v for k, v in ((k, reward_number(v)) for k, v in reward.items()) if v is not None}
            return
        if names and reward is not None:
            raise ValueError(f"{reward!r} is not a dict of the rewards environment.reward_weights names")
        record.env_reward = reward_number(reward)

    def _messages(self, played: Played | None, req: EpisodeRequests, completion: list[int]) -> list[dict[str, Any]]:
        """What the reward functions get as the episode's completion (producer.Played.messages)."""
        if played is not None and played.messages is not None:
            return list(played.messages)
        chat = [t for t in req.turns if t.messages is not None]
        if chat:
            last = chat[-1]
            content = last.completion_ids
            if content and content[-1] in self.eos_token_ids:
                content = content[:-1]
            reply = self.tokenizer.decode(content, skip_special_tokens=False)
            return [*(last.messages or []), {"role": "assistant", "content": reply}]
        return [{"role": "assistant", "content": self.tokenizer.decode(completion, skip_special_tokens=True)}]

    def _counters(self, records: list[AgentEpisodeRecord]) -> dict[str, float]:
        """The batch's totals on this rank, under names every rank has (logged as environment/<name>)."""
        totals = {
            "agent/episodes": float(len(records)),
            "agent/requests": float(sum(r.requests for r in records)),
            "agent/refused": float(sum(sum(r.refused.values()) for r in records)),
            "agent/completion_tokens": float(sum(r.completion_tokens for r in records)),
            "agent/branches": float(sum(r.branches for r in records)),
            "agent/branch_rows": float(sum(max(r.branches - 1, 0) for r in records)),  # rows besides the completions
            "agent/rerendered_turns": float(sum(r.rerendered_turns for r in records)),
            "agent/sampler_seconds": float(sum(r.sampler_seconds for r in records)),
        }
        for name in self.counter_names:
            totals[f"agent/{name}"] = float(sum(r.counters.get(name, 0.0) for r in records))
        if self.stop_names:
            for name in self.stop_names:
                totals[f"agent/stop/{name}"] = 0.0
            for r in records:
                name = r.stop_condition or NO_STOP
                totals[f"agent/stop/{name if name in self.stop_names else OTHER_STOP}"] += 1.0
        return totals


NO_STOP = "none"  # the player named no stop condition (an episode that failed before it returned, too)
OTHER_STOP = "other"  # a stop condition the player did not declare


def stop_names(player: Player) -> tuple[str, ...]:
    """The stop conditions counted per name (`environment/agent/stop/<name>`): the player's declared
    `stop_conditions`, then `none` and `other`; () for a player that declares none (nothing counted). Declared, not
    collected from the episodes, so that every rank logs the same names at every step (they are summed over ranks)."""
    declared = getattr(player, "stop_conditions", None)
    if declared is None:
        return ()
    return tuple(dict.fromkeys([*declared, NO_STOP, OTHER_STOP]))


def agent_engine(engine: RolloutEngine, tokenizer, cfg: Config, eos_token_ids: list[int], environment) -> AgentEngine:
    """`engine` behind the endpoint, played by the run's player (`environment`: a PlayerEnvironment). The context the
    endpoint caps requests by: the model's on the hf engine, rollout.vllm.max_model_len (else DEFAULT_CONTEXT) on a
    vLLM engine."""
    from ..errors import ConfigError

    if lockstep_of(engine) is not None:
        raise ConfigError(
            f"{environment.name}: the hf engine under FSDP samples in lockstep (every rank the same generate calls), "
            "and each rank's agents form their own batches: use DDP or DeepSpeed, or a vLLM engine"
        )
    env, vllm = cfg.environment, capability(engine, SamplesTrainingModel) is None  # else the training model samples
    return AgentEngine(
        engine,
        environment,
        tokenizer,
        seed=cfg.seed,
        eos_token_ids=eos_token_ids,
        max_completion_length=cfg.rollout.max_completion_length,
        max_model_len=cfg.rollout.vllm.max_model_len if vllm else None,
        vocab_size=_vocab_size(cfg) if vllm else None,
        episode_timeout=env.episode_timeout if math.isfinite(env.episode_timeout) else math.inf,
        concurrency=env.concurrency,
        rounds=cfg.rollout.seed_per_prompt,
    )


def _vocab_size(cfg: Config) -> int | None:
    """The policy's vocabulary rows, from its config (None where it cannot be read)."""
    from ..builtin import resolve_model_path

    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            resolve_model_path(cfg.model.name_or_path), trust_remote_code=cfg.model.trust_remote_code
        )
    except Exception:  # noqa: BLE001 (then the tokenizer's vocabulary is the bound)
        return None
    size = getattr(config.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) else None


if TYPE_CHECKING:
    # mypy checks that the wrapper satisfies RolloutEngine, as every engine does (tests/test_engines.py at run time).
    _agent_engine: type[RolloutEngine] = AgentEngine
