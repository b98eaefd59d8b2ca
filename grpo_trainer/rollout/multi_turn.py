"""Multi-turn rollouts with tool calls (`rollout.tools`), on top of any engine.

`MultiTurnEngine` wraps an engine (hf, vllm_colocate, vllm_server) and keeps its
interface, so the loop does not know tools exist: `generate` (with `max_tokens`), and every other member of the
`RolloutEngine` protocol forwarded explicitly to the wrapped engine (its capabilities `needs_weight_sync`,
`samples_outside_process`, `can_lose_weights`, `lockstep`; `reconnect` to a server the trainer waits for after
a restart; pushes, kernels, memory). Nothing outside the protocol is forwarded: what the loop may ask an engine
is the protocol, and a capability the wrapper lacked would silently change what the loop does with tools
(tests/test_engines.py checks every member is here). A completion becomes a
conversation, all of it one token sequence after the prompt:

    prompt | model turn 1 ... <tool_call>{...}</tool_call><EOS> | tool tokens | model turn 2 ... <EOS>

1. The engine samples the first turn of every completion (G per prompt, as without tools).
2. Each turn that ended with EOS and holds tool calls has them run: all calls of the batch at once, in
   threads (tools.ToolBox). A turn without calls, or cut by the length limit, ends its conversation.
3. The tool messages are rendered by the tokenizer's own chat template, and the tokens between the
   model's EOS and its next turn (`ToolMessageTokens`) are appended. They are marked 0 in
   `Rollout.completion_mask`: the model did not write them, so they carry no loss (and count in no
   normaliser); they stay in the sequence, so the next turn, and the trainer's single forward pass over
   the whole conversation, condition on them.
4. The engine continues every conversation that called a tool from its whole context (prompt + everything
   so far) with one completion each, up to what is left of `rollout.max_completion_length`, which bounds
   model and tool tokens together. At most `rollout.max_tool_turns` rounds of tool calls are run; a call
   after the last is left unanswered and ends the conversation.

The tokens the engine sampled are kept exactly, never re-tokenized from text, so the trainer's log-probs
are those of the tokens the sampler drew (vLLM's sampling log-probs line up token for token; tool tokens
get 0 there and are masked). Rewards receive each completion as its messages (assistant turns with their
parsed `tool_calls`, tool results), TRL's form for conversational completions, and a `tool_calls` count.
With `rollout.seed_per_prompt`, turn k of completion i of a prompt is drawn from a seed mixed from the
prompt's seed, i and k: the result does not depend on batching or the number of ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import Rollout, RolloutEngine, SamplingSettings, mix_seed

if TYPE_CHECKING:
    from ..config import Config
from .tools import ToolBox, ToolCall, ToolResult, parse_tool_calls

PLACEHOLDER = "-"  # content of the stand-in conversation tool messages are rendered after


class ToolMessageTokens:
    """The tokens the chat template puts between a model turn (ended by EOS) and the model's next turn.

    Rendered from the template itself: a stand-in conversation ending with an assistant turn, with and without
    the tool messages and the next generation prompt; the difference, plus whatever the template writes after
    the assistant's EOS (ChatML: a newline), is what the model would have seen in a real conversation.
    """

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        base = [{"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": PLACEHOLDER}]
        self.base = base
        self.before = self._render(base, add_generation_prompt=False)
        eos = tokenizer.eos_token
        end = self.before.rfind(eos) if eos else -1
        if end < self.before.rfind(PLACEHOLDER):
            raise ValueError(
                "rollout.tools: the chat template does not end an assistant turn with the EOS token "
                f"({eos!r}); multi-turn rollouts continue a conversation after the model's EOS"
            )
        self.after_eos = self.before[end + len(eos) :]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def __call__(self, results: list[ToolResult]) -> list[int]:
        messages = [{"role": "tool", "name": r.name, "content": r.output} for r in results]
        after = self._render(self.base + messages, add_generation_prompt=True)
        if not after.startswith(self.before):
            raise ValueError("rollout.tools: the chat template renders earlier messages differently once tool messages follow")
        text = self.after_eos + after[len(self.before) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(eq=False)  # compared by identity: two conversations may well hold the same tokens
class Conversation:
    """One completion as it grows: its tokens (model and tool), which the model wrote, and its messages."""

    prompt: list[int]
    seed: int | None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: written by the model
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall | ToolResult] = field(default_factory=list)  # the last turn's
    ended_with_eos: bool = False
    truncated: bool = False
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0

    def add_model_turn(self, tokens: list[int], truncated: bool, logprobs: list[float] | None, tokenizer,
                       eos_token_ids: set[int]) -> None:
        self.ids += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.turns += 1
        self.truncated = truncated
        self.ended_with_eos = bool(tokens) and tokens[-1] in eos_token_ids
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        self.calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parsed = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for c in self.calls if isinstance(c, ToolCall)]
        if parsed:
            message["tool_calls"] = parsed
        self.messages.append(message)

    def add_tool_results(self, results: list[ToolResult], tokens: list[int]) -> None:
        self.ids += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.tool_calls += len(results)
        self.tool_errors += sum(r.error for r in results)
        self.messages += [{"role": "tool", "name": r.name, "content": r.output} for r in results]


class MultiTurnEngine:
    """An engine whose completions may call tools; see the module docstring."""

    def __init__(self, engine: RolloutEngine, toolbox: ToolBox, tokenizer, *, eos_token_ids: list[int],
                 max_completion_length: int, max_tool_turns: int, template_kwargs: dict[str, Any] | None = None):
        self.engine = engine
        self.toolbox = toolbox
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.max_tool_turns = max_tool_turns
        self.tool_tokens = ToolMessageTokens(tokenizer, template_kwargs)

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

    def plan_kernels(self, max_rows: int, max_context: int, recorded: Mapping[str, str] | None = None,
                     decide: bool = True) -> dict[str, str]:
        return self.engine.plan_kernels(max_rows, max_context, recorded, decide)

    def use_kernels(self, plan: Mapping[str, str]) -> None:
        self.engine.use_kernels(plan)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ the multi-turn loop
    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None,
                 max_tokens: int | None = None) -> Rollout:
        """`max_tokens` lowers rollout.max_completion_length for this call: it bounds each conversation's model and
        tool tokens together, as that limit does."""
        g = num_generations
        limit = min(max_tokens, self.max_completion_length) if max_tokens else self.max_completion_length
        first = self.engine.generate(prompt_ids, g, seeds=seeds, max_tokens=limit if max_tokens else None)
        conversations = [Conversation(prompt_ids[j // g], None if seeds is None else mix_seed(seeds[j // g], j % g))
                         for j in range(len(first.completion_ids))]
        for j, conv in enumerate(conversations):
            conv.add_model_turn(first.completion_ids[j], first.truncated[j], _row(first.sampling_logprobs, j),
                                self.tokenizer, self.eos_token_ids)
        tool_seconds = 0.0
        # With `lockstep` (the hf engine under FSDP) every rank must make the same generate calls:
        # then a round runs while any rank has a conversation going, the others calling with nothing.
        lockstep = self.engine.lockstep
        for round_ in range(1, self.max_tool_turns + 1):
            acting = [c for c in conversations if not c.done and c.calls and c.ended_with_eos]
            for conv in conversations:
                if conv not in acting:
                    conv.done = True
            if not (acting if lockstep is None else int(lockstep.max(torch.tensor([len(acting)]))[0])):
                break
            started = time.perf_counter()
            results = self.toolbox.run([call for conv in acting for call in conv.calls])
            tool_seconds += time.perf_counter() - started
            going: list[tuple[Conversation, int]] = []  # with the tokens each may still write
            for conv in acting:
                mine, results = results[: len(conv.calls)], results[len(conv.calls) :]
                tokens = self.tool_tokens(mine)
                room = limit - len(conv.ids) - len(tokens)
                if room <= 0:  # no room for the answer: the conversation ends at the length limit
                    conv.truncated, conv.done = True, True
                    continue
                conv.add_tool_results(mine, tokens)
                going.append((conv, room))
            if going or lockstep is not None:
                self._continue(going, round_)
        return Rollout(
            completion_ids=[c.ids for c in conversations],
            truncated=[c.truncated for c in conversations],
            sampling_logprobs=[c.logprobs for c in conversations] if first.sampling_logprobs is not None else None,
            completion_mask=[c.mask for c in conversations],
            conversations=[c.messages for c in conversations],
            tool_calls=[c.tool_calls for c in conversations],
            tool_errors=[c.tool_errors for c in conversations],
            turns=[c.turns for c in conversations],
            tool_seconds=tool_seconds,
        )

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


def with_tools(engine: RolloutEngine, toolbox: ToolBox | None, tokenizer, cfg: Config, sampling: SamplingSettings) -> RolloutEngine:
    """`engine` itself without tools; with them, the multi-turn loop around it."""
    if toolbox is None:
        return engine
    return MultiTurnEngine(engine, toolbox, tokenizer, eos_token_ids=sampling.eos_token_ids,
                           max_completion_length=sampling.max_completion_length,
                           max_tool_turns=cfg.rollout.max_tool_turns, template_kwargs=cfg.data.chat_template_kwargs)


def _row(values: list | None, j: int):
    return None if values is None else values[j]
