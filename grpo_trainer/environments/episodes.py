"""Multi-turn rollouts: episodes played against environments (`environment:`, `environment.tools`), on any engine.

`EpisodeEngine` wraps an engine (hf, vllm_colocate, vllm_server) and keeps its interface, so the loop does not
know environments exist: `generate` (with `max_tokens`, and `episodes=` where the engine `needs_episodes`), and
every other member of the `RolloutEngine` protocol forwarded explicitly to the wrapped engine (its capabilities
`needs_weight_sync`, `samples_outside_process`, `can_lose_weights`, `lockstep`; `reconnect` to a server the
trainer waits for after a restart; pushes, kernels, memory). Nothing outside the protocol is forwarded: what the
loop may ask an engine is the protocol, and a capability the wrapper lacked would silently change what the loop
does (tests/test_engines.py checks every member is here). It talks to environments only through the `Episode`
protocol (grpo_trainer/environments), so the built-in tools environment (`environment.tools`), a TRL-style class and
OpenEnv all run on this one loop. A completion becomes an episode, all of it one token sequence after the prompt:

    prompt [+ reset text] | model turn 1 ... <EOS> | environment tokens | model turn 2 ... <EOS> | ...

0. With `episodes=` (one EpisodeSpec per prompt), G fresh environment objects per prompt are made and reset (all at
   once, in EnvCalls' threads); a reset text extends the group's prompt (`Rollout.prompt_ids`). Steps 0-5 run
   in waves of whole groups when the environment has a `capacity` (a remote server's sessions) smaller than the
   batch's episodes: no more episodes hold a session than the rank has.
1. The engine samples the first turn of every completion (G per prompt, as without environments).
2. Each turn that ended with EOS is answered by its episode (`respond`: its tool calls, or its plain reply), all
   episodes at once. No answer, the environment's `done`, or a turn cut by the length limit ends the episode.
3. The environment's messages are rendered by the tokenizer's own chat template, and the tokens between the
   model's EOS and its next turn (`EnvMessageTokens`) are appended. They are marked 0 in
   `Rollout.completion_mask`: the model did not write them, so they carry no loss (and count in no
   normaliser); they stay in the sequence, so the next turn, and the trainer's single forward pass over
   the whole conversation, condition on them.
4. The engine continues every episode still going from its whole context (prompt + everything so far) with one
   completion each, up to what is left of `rollout.max_completion_length`, which bounds model and environment
   tokens together. At most `max_turns` model turns are played (an episode still going then ends: `turns`).
5. At the end each episode is scored (`reward`), snapshotted for the reward functions and closed.

The tokens the engine sampled are kept exactly, never re-tokenized from text, so the trainer's log-probs
are those of the tokens the sampler drew (vLLM's sampling log-probs line up token for token; environment tokens
get 0 there and are masked). Rewards receive each completion as its messages (assistant turns with their
parsed `tool_calls`, tool and user messages), TRL's form for conversational completions, and a `tool_calls` count.
With `rollout.seed_per_prompt`, turn k of completion i of a prompt is drawn from a seed mixed from the
prompt's seed, i and k: the result does not depend on batching or the number of ranks.

Whatever an environment does (raises, hangs, breaks its protocol, sends a huge message) ends that episode alone:
its calls run in EnvCalls (timeouts: environment.step_timeout, environment.episode_timeout), a failure is recorded
in its `EpisodeRecord` (scored by environment.on_error, in Task.score), a message is cut to
environment.observation_chars.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..rollout import Rollout, RolloutEngine, SamplingSettings
from ..seeds import mix_seed
from .calls import EnvCalls, EpisodeBudget, Outcome
from .protocol import (
    ENDED_BY_ENVIRONMENT,
    ENDED_BY_LENGTH,
    ENDED_BY_MODEL,
    ENDED_BY_TURNS,
    FAILED_DISCONNECT,
    FAILED_ERROR,
    FAILED_TIMEOUT,
    Environment,
    Episode,
    EpisodeRecord,
    EpisodeSpec,
)
from .scoring import failure_summary
from .tools import ToolBox, ToolCall, ToolResult, parse_tool_calls

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger("grpo_trainer")

PLACEHOLDER = "-"  # content of the stand-in conversation environment messages are rendered after
ABANDONED_PER_WORKER = 4  # hung calls still running, per worker of EnvCalls, before the run stops


class EnvMessageTokens:
    """The tokens the chat template puts between a model turn (ended by EOS) and the model's next turn, for given
    environment messages (tool or user role).

    Rendered from the template itself: a stand-in conversation ending with an assistant turn, with and without
    the messages and the next generation prompt; the difference, plus whatever the template writes after
    the assistant's EOS (ChatML: a newline), is what the model would have seen in a real conversation.
    `where` names the config key in errors.
    """

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None, where: str = "environment.tools"):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.where = where
        base = [{"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": PLACEHOLDER}]
        self.base = base
        self.before = self._render(base, add_generation_prompt=False)
        eos = tokenizer.eos_token
        end = self.before.rfind(eos) if eos else -1
        if end < self.before.rfind(PLACEHOLDER):
            raise ValueError(
                f"{where}: the chat template does not end an assistant turn with the EOS token "
                f"({eos!r}); multi-turn rollouts continue a conversation after the model's EOS"
            )
        self.after_eos = self.before[end + len(eos) :]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        after = self._render(self.base + messages, add_generation_prompt=True)
        if not after.startswith(self.before):
            raise ValueError(
                f"{self.where}: the chat template renders earlier messages differently once environment messages follow"
            )
        text = self.after_eos + after[len(self.before) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(eq=False)  # compared by identity: two conversations may well hold the same tokens
class Conversation:
    """One completion as it grows: its tokens (model and environment), which the model wrote, its messages, and
    the episode behind it."""

    prompt: list[int]
    seed: int | None
    episode: Episode | None = None
    budget: EpisodeBudget | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: written by the model
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall | ToolResult] = field(default_factory=list)  # the last turn's
    text: str = ""  # the last turn's, decoded
    ended_with_eos: bool = False
    truncated: bool = False
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0
    record: EpisodeRecord = field(default_factory=lambda: EpisodeRecord(ended_by=ENDED_BY_TURNS))
    untouchable: bool = False  # a call of its episode timed out: the object is never used again

    @property
    def live_episode(self) -> Episode:
        """The episode, once `_make_episodes` made it (the loop calls it only then)."""
        assert self.episode is not None, "the conversation's episode is not made yet"
        return self.episode

    @property
    def limits(self) -> EpisodeBudget:
        """The episode's time budget, set before its first environment call."""
        assert self.budget is not None, "the conversation's budget is not set yet"
        return self.budget

    def add_model_turn(
        self, tokens: list[int], truncated: bool, logprobs: list[float] | None, tokenizer, eos_token_ids: set[int]
    ) -> None:
        self.ids += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.turns += 1
        self.truncated = truncated
        self.ended_with_eos = bool(tokens) and tokens[-1] in eos_token_ids
        self.text = tokenizer.decode(tokens, skip_special_tokens=True)
        self.calls = parse_tool_calls(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        parsed = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
            if isinstance(c, ToolCall)
        ]
        if parsed:
            message["tool_calls"] = parsed
        self.messages.append(message)

    def add_environment_messages(self, messages: list[dict[str, Any]], tokens: list[int]) -> None:
        self.ids += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.messages += messages

    def end(self, ended_by: str, error: str | None = None) -> None:
        self.done = True
        self.record.ended_by, self.record.error = ended_by, error

    def fail(self, outcome: Outcome, what: str) -> None:
        """End the episode as an environment failure: a call that timed out, lost its connection (a remote
        server's ConnectionError: `disconnect`, counted apart from the environment's own errors) or raised."""
        if outcome.timed_out is not None:
            self.untouchable = True
            self.end(FAILED_TIMEOUT, f"{what} did not return within environment.{outcome.timed_out}_timeout")
        elif isinstance(outcome.exception, ConnectionError):
            self.end(FAILED_DISCONNECT, f"{what}: {outcome.error}")
        else:
            self.end(FAILED_ERROR, f"{what}: {outcome.error}")


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes are run (the `environment` section; for environment.tools alone, values that reproduce the tool
    loop that came before: no cutting, no environment limit beyond the tools' own)."""

    max_turns: int
    step_timeout: float
    episode_timeout: float
    concurrency: int
    observation_chars: int | None  # None: messages are not cut (the tool box already cut tool outputs)
    record: bool  # episodes are recorded in the Rollout (`episodes`, `environments`, env metrics): environments only


class EpisodeEngine:
    """An engine whose completions are episodes in an environment; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        environment: Environment,
        tokenizer,
        *,
        eos_token_ids: list[int],
        max_completion_length: int,
        settings: EpisodeSettings,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.environment = environment
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.settings = settings
        self.env_tokens = EnvMessageTokens(tokenizer, template_kwargs, where=environment.name)
        self.calls = EnvCalls(settings.concurrency, environment.name, ABANDONED_PER_WORKER * settings.concurrency)

    @property
    def needs_episodes(self) -> bool:
        """Whether `generate` wants `episodes=` (one EpisodeSpec per prompt): every environment but environment.tools'."""
        return self.settings.record

    # ------------------------------------------------------------------ the wrapped engine's, forwarded
    @property
    def needs_weight_sync(self) -> bool:
        return self.engine.needs_weight_sync

    @property
    def samples_outside_process(self) -> bool:
        return self.engine.samples_outside_process

    @property
    def can_lose_weights(self) -> bool:
        return self.engine.can_lose_weights

    @property
    def lockstep(self) -> Any:
        return self.engine.lockstep

    def reconnect(self, timeout: float) -> bool:
        return self.engine.reconnect(timeout)

    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Any = None) -> None:
        self.engine.sync_weights(model, version=version, gather=gather)

    def plan_kernels(
        self, max_rows: int, max_context: int, recorded: Mapping[str, str] | None = None, decide: bool = True
    ) -> dict[str, str]:
        return self.engine.plan_kernels(max_rows, max_context, recorded, decide)

    def use_kernels(self, plan: Mapping[str, str]) -> None:
        self.engine.use_kernels(plan)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        """The loop's threads and the wrapped engine; not the environment, which is shared (the run's task, engine
        and evaluator play the one built for the run) and closed by whoever built it."""
        self.calls.close()
        self.engine.close()

    # ------------------------------------------------------------------ the episode loop
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[EpisodeSpec] | None = None,
    ) -> Rollout:
        """`max_tokens` lowers rollout.max_completion_length for this call: it bounds each conversation's model and
        environment tokens together, as that limit does. `episodes`: one per prompt (environments that reset from
        the row and the seed need it; without, episodes start without a reset).

        The prompts are played in waves of whole groups, no more episodes alive at once than the environment's
        `capacity` (a remote server's sessions held by this rank; one wave when it has no limit). Each
        completion's tokens depend only on its prompt, its seed and its episode, so the waves change nothing but
        the time taken (with rollout.seed_per_prompt; without, the sampler's batches differ, as with any batch size)."""
        g = num_generations
        before = self.environment.counters()
        parts = [
            self._play(
                prompt_ids[a:b],
                g,
                None if seeds is None else seeds[a:b],
                max_tokens,
                None if episodes is None else episodes[a:b],
            )
            for a, b in self._waves(len(prompt_ids), g)
        ]
        played = [part for part in parts if part.completion_ids] or parts[:1]  # a lockstep rank's empty waves: none
        rollout = played[0] if len(played) == 1 else Rollout.concat(played)
        if self.settings.record:
            after = self.environment.counters()
            rollout.env_counters = {name: after[name] - before.get(name, 0) for name in after}
            for line in failure_summary(self.environment.name, rollout.episodes or []):
                logger.warning("%s", line)  # the first error of each kind: a failing environment shows
        return rollout

    def _waves(self, prompts: int, g: int) -> list[tuple[int, int]]:
        """The waves, as ranges of prompts: as many whole groups as `environment.capacity` holds. With `lockstep`,
        every rank plays as many waves as the rank with the most (the others' last waves are empty), since every
        rank must make the same generate calls."""
        capacity = self.environment.capacity
        lockstep = self.engine.lockstep
        if capacity is None or (prompts * g <= capacity and lockstep is None):
            return [(0, prompts)]
        if g > capacity:
            raise ConfigError(
                f"{self.environment.name}: a group's {g} episodes must play at once, and this rank can run {capacity} "
                f"(environment.concurrency, or the sessions the server accepts): start the server with more sessions "
                f"(max_concurrent_envs), or sample fewer completions per prompt"
            )
        per = capacity // g
        waves = [(a, min(a + per, prompts)) for a in range(0, prompts, per)] or [(0, 0)]
        if lockstep is not None:
            waves += [(prompts, prompts)] * (int(lockstep.max(torch.tensor([len(waves)]))[0]) - len(waves))
        return waves

    def _play(
        self,
        prompt_ids: list[list[int]],
        g: int,
        seeds: list[int] | None,
        max_tokens: int | None,
        episodes: list[EpisodeSpec] | None,
    ) -> Rollout:
        """One wave: its episodes made, reset, played to their end, scored and closed."""
        limit = min(max_tokens, self.max_completion_length) if max_tokens else self.max_completion_length
        conversations = [
            Conversation(prompt_ids[j // g], None if seeds is None else mix_seed(seeds[j // g], j % g))
            for j in range(len(prompt_ids) * g)
        ]
        env_seconds = (
            self._start(conversations, g, episodes) if episodes is not None else self._start_plain(conversations)
        )
        prompts = [conversations[i * g].prompt for i in range(len(prompt_ids))]
        first = self.engine.generate(prompts, g, seeds=seeds, max_tokens=limit if max_tokens else None)
        for j, conv in enumerate(conversations):
            conv.add_model_turn(
                first.completion_ids[j],
                first.truncated[j],
                _row(first.sampling_logprobs, j),
                self.tokenizer,
                self.eos_token_ids,
            )
        respond_seconds = 0.0
        # With `lockstep` (the hf engine under FSDP) every rank must make the same generate calls:
        # then a round runs while any rank has a conversation going, the others calling with nothing.
        lockstep = self.engine.lockstep
        for round_ in range(1, self.settings.max_turns):
            acting = []
            for conv in conversations:
                if conv.done:
                    continue
                if not conv.ended_with_eos:  # cut by the length limit (or a stop string): its calls are not run
                    conv.end(ENDED_BY_LENGTH if conv.truncated else ENDED_BY_MODEL)
                else:
                    acting.append(conv)
            tick = time.perf_counter()
            outcomes = self.calls.run([(_respond(conv), conv.limits) for conv in acting])
            respond_seconds += time.perf_counter() - tick
            going: list[tuple[Conversation, int]] = []  # with the tokens each may still write
            for conv, outcome in zip(acting, outcomes):
                room = self._answer(conv, outcome, limit)
                if room is not None:
                    going.append((conv, room))
            if not (going if lockstep is None else int(lockstep.max(torch.tensor([len(going)]))[0])):
                break
            self._continue(going, round_)
        for conv in conversations:
            if not conv.done:  # still going after max_turns model turns (its last turn unanswered), or just cut
                conv.end(
                    ENDED_BY_TURNS if conv.ended_with_eos else (ENDED_BY_LENGTH if conv.truncated else ENDED_BY_MODEL)
                )
        tick = time.perf_counter()
        environments = self._finish(conversations) if self.settings.record else None
        env_seconds += respond_seconds + time.perf_counter() - tick
        rollout = Rollout(
            completion_ids=[c.ids for c in conversations],
            truncated=[c.truncated for c in conversations],
            sampling_logprobs=[c.logprobs for c in conversations] if first.sampling_logprobs is not None else None,
            completion_mask=[c.mask for c in conversations],
            conversations=[c.messages for c in conversations],
            tool_calls=[c.tool_calls for c in conversations],
            tool_errors=[c.tool_errors for c in conversations],
            turns=[c.turns for c in conversations],
            tool_seconds=respond_seconds,
        )
        if self.settings.record:
            for conv in conversations:
                conv.record.turns = conv.turns
            rollout.prompt_ids = [c.prompt for c in conversations]
            rollout.episodes = [c.record for c in conversations]
            rollout.environments = environments
            rollout.env_seconds = env_seconds
        return rollout

    def _start_plain(self, conversations: list[Conversation]) -> float:
        """Episodes without a reset (environment.tools; evaluation of an environment without specs is refused)."""
        if self.settings.record:
            raise ValueError(f"{self.environment.name}: episodes need their dataset rows and seeds (episodes=)")
        for conv in conversations:
            conv.episode = self.environment.episode()
            conv.budget = EpisodeBudget(self.settings.step_timeout, self.settings.episode_timeout)
        return 0.0

    def _start(self, conversations: list[Conversation], g: int, episodes: list[EpisodeSpec]) -> float:
        """Make and reset every episode (all at once); a group's prompt is extended by its episode 0's reset text.
        An episode that fails here, or whose reset text differs from its episode 0's, is a failure from the start:
        it is still sampled (its first turn is part of the batched generate) but never answered."""
        tick = time.perf_counter()
        for conv in conversations:
            conv.budget = EpisodeBudget(self.settings.step_timeout, self.settings.episode_timeout)
        made = self.calls.run([(self.environment.episode, conv.limits) for conv in conversations])
        ready = []
        for conv, outcome in zip(conversations, made):
            if outcome.ok:
                conv.episode = outcome.value
                ready.append(conv)
            else:
                conv.fail(outcome, "making the environment")
        index = {id(conv): j for j, conv in enumerate(conversations)}
        texts = self.calls.run(
            [
                (_reset(conv.live_episode, episodes[index[id(conv)] // g], index[id(conv)] % g), conv.limits)
                for conv in ready
            ]
        )
        text_of: dict[int, str | None] = {}
        for conv, outcome in zip(ready, texts):
            if outcome.ok:
                text_of[index[id(conv)]] = outcome.value
            else:
                conv.fail(outcome, "reset")
        for i, spec in enumerate(episodes):
            text = text_of.get(i * g)
            prompt = conversations[i * g].prompt
            if text is not None:
                try:
                    prompt = spec.extend_prompt(text)
                except Exception as exc:  # noqa: BLE001 (e.g. the prompt no longer fits): the group fails
                    for conv in conversations[i * g : (i + 1) * g]:
                        if not conv.done:
                            conv.end(FAILED_ERROR, f"the prompt with reset's text: {type(exc).__name__}: {exc}")
            for j in range(i * g, (i + 1) * g):
                conversations[j].prompt = prompt
                conversations[j].record.group = spec.episode_id
                if j in text_of and text_of[j] != text and not conversations[j].done:
                    conversations[j].end(FAILED_ERROR, "reset returned a different text than the group's first episode")
        return time.perf_counter() - tick

    def _answer(self, conv: Conversation, outcome: Outcome, limit: int) -> int | None:
        """Take the episode's answer to the model's last turn; the room left for the next turn if it goes on."""
        if not outcome.ok:
            conv.fail(outcome, "respond")
            return None
        reply = outcome.value
        conv.tool_calls += reply.tool_calls
        conv.tool_errors += reply.tool_errors
        conv.record.invalid_actions += reply.invalid_actions
        if not reply.messages:
            conv.end(ENDED_BY_ENVIRONMENT if reply.done else ENDED_BY_MODEL)
            return None
        messages = [self._cut(conv, m) for m in reply.messages]
        if reply.done:  # kept for the rewards; no model turn follows, so no tokens either
            conv.messages += messages
            conv.end(ENDED_BY_ENVIRONMENT)
            return None
        tokens = self.env_tokens(messages)
        room = limit - len(conv.ids) - len(tokens)
        if room <= 0:  # no room for the answer: the conversation ends at the length limit
            conv.truncated = True
            conv.end(ENDED_BY_LENGTH)
            return None
        conv.add_environment_messages(messages, tokens)
        return room

    def _cut(self, conv: Conversation, message: dict[str, Any]) -> dict[str, Any]:
        limit, content = self.settings.observation_chars, message.get("content")
        if limit is None or not isinstance(content, str) or len(content) <= limit:
            return message
        conv.record.observations_cut += 1
        return {**message, "content": cut_within(content, limit)}

    def _finish(self, conversations: list[Conversation]) -> list[Any]:
        """Score, snapshot and close every episode that did not hang (a timed-out object is never touched again)."""
        alive = [c for c in conversations if c.episode is not None and not c.untouchable]
        if self.environment.has_reward:
            scored = [c for c in alive if not c.record.failed]
            for conv, outcome in zip(
                scored, self.calls.run([(conv.live_episode.reward, conv.limits) for conv in scored])
            ):
                if outcome.ok:
                    conv.record.env_reward = outcome.value
                else:
                    conv.fail(outcome, "the reward")
        alive = [c for c in alive if not c.untouchable]
        shots = self.calls.run([(conv.live_episode.snapshot, conv.limits) for conv in alive])
        snapshot = {id(conv): outcome.value for conv, outcome in zip(alive, shots)}
        for conv, outcome in zip(alive, shots):
            if outcome.timed_out is not None:  # abandoned: the object is not closed either
                conv.untouchable = True
        alive = [c for c in alive if not c.untouchable]
        for conv, outcome in zip(
            alive, self.calls.run([(conv.live_episode.close, self.settings.step_timeout) for conv in alive])
        ):
            if not outcome.ok and not conv.record.failed:
                conv.fail(outcome, "close")
        for conv in conversations:
            conv.record.env_seconds = self.settings.episode_timeout - conv.budget.left if conv.budget else 0.0
        return [snapshot.get(id(conv)) for conv in conversations]

    def _continue(self, going: list[tuple[Conversation, int]], round_: int) -> None:
        """The next model turn of each conversation, from its whole context, within its own room."""
        contexts = [conv.prompt + conv.ids for conv, _ in going]
        seeds = None
        if going and going[0][0].seed is not None:
            seeds = [mix_seed(conv.seed, round_) for conv, _ in going if conv.seed is not None]  # all have one
        out = self.engine.generate(contexts, 1, seeds=seeds, max_tokens=max((room for _, room in going), default=1))
        for j, (conv, room) in enumerate(going):
            tokens, truncated, logprobs = out.completion_ids[j], out.truncated[j], _row(out.sampling_logprobs, j)
            if len(tokens) > room:  # drawn with the largest room of the batch: cut to this conversation's own
                tokens, truncated = tokens[:room], True
                logprobs = None if logprobs is None else logprobs[:room]
            conv.add_model_turn(tokens, truncated, logprobs, self.tokenizer, self.eos_token_ids)


def tools_settings(toolbox: ToolBox, max_tool_turns: int) -> EpisodeSettings:
    """The built-in tools environment's settings: the tool box's own limits apply (its calls answer a timeout
    themselves), so the environment's are only a backstop far above them."""
    return EpisodeSettings(
        max_turns=max_tool_turns + 1,
        step_timeout=4 * toolbox.timeout + 60,
        episode_timeout=math.inf,
        concurrency=TOOLS_CONCURRENCY,
        observation_chars=None,
        record=False,
    )


TOOLS_CONCURRENCY = 64  # episodes answered at once (each runs its calls in the tool box's own threads)


def with_environment(
    engine: RolloutEngine, tokenizer, cfg: Config, sampling: SamplingSettings, environment: Environment | None
) -> RolloutEngine:
    """`engine` itself without an environment; with one (the run's, `build_environment(cfg)`: `environment:`, or
    environment.tools alone), the episode loop around it. The environment stays its builder's to close."""
    if environment is None:
        return engine
    from ..agents.producer import PlayerEnvironment

    if isinstance(environment, PlayerEnvironment):  # an agent program (environment.agent): agents/engine.py
        from ..agents.engine import agent_engine

        return agent_engine(engine, tokenizer, cfg, sampling.eos_token_ids, environment)
    env = cfg.environment
    if env.kind is None:  # environment.tools alone: the built-in tools environment
        from .tools_env import ToolsEnvironment

        assert isinstance(environment, ToolsEnvironment), f"environment.tools alone built {type(environment).__name__}"
        settings = tools_settings(environment.box, cfg.environment.max_tool_turns)
    else:
        settings = EpisodeSettings(
            max_turns=env.max_turns,
            step_timeout=env.step_timeout,
            episode_timeout=env.episode_timeout,
            concurrency=env.concurrency,
            observation_chars=env.observation_chars,
            record=True,
        )
    return EpisodeEngine(
        engine,
        environment,
        tokenizer,
        eos_token_ids=sampling.eos_token_ids,
        max_completion_length=sampling.max_completion_length,
        settings=settings,
        template_kwargs=cfg.data.chat_template_kwargs,
    )


def cut_within(text: str, limit: int) -> str:
    """At most `limit` characters in all, the note of how much was left out counted: the start of `text` and
    `[... N more characters]`, or only the start where the note alone would not fit."""
    if len(text) <= limit:
        return text
    keep = limit
    for _ in range(3):  # the note's length depends on N, which depends on what is kept: settles in two rounds
        note = f"\n[... {len(text) - keep} more characters]"
        keep = limit - len(note)
    if keep <= 0:
        return text[:limit]
    return text[:keep] + f"\n[... {len(text) - keep} more characters]"


def _respond(conv: Conversation):
    return lambda: conv.live_episode.respond(conv.text, conv.calls)


def _reset(episode: Episode, spec: EpisodeSpec, j: int):
    """Each episode resets from its own copy of the row: a reset that changes a nested value of it must change
    neither its siblings' row nor the dataset (the next epoch's)."""
    return lambda: episode.reset(replace(spec, record=copy.deepcopy(spec.record)), j)


def _row(values: list | None, j: int):
    return None if values is None else values[j]


if TYPE_CHECKING:
    # mypy checks that the wrapper satisfies RolloutEngine, members and signatures, as every engine does
    # (rollout/registry.py); tests/test_engines.py checks the same at run time.
    _episode_engine: type[RolloutEngine] = EpisodeEngine
