"""Group sampling with the transformers model itself: the engine that runs everywhere.

It samples from the training model (unwrapped from DDP), so there are no
weights to push: `sync_weights` is a no-op. It reports no sampling log-probs:
the sampler is the trained model itself, so there is no sampler/trainer
mismatch to measure.

With `share_prompt` (the default) it runs its own decode loop: each prompt is
prefilled once and its KV cache copied to its G completions, and rows that
have finished are dropped from the batch instead of being decoded as padding
to the end; the loop runs with `decode.decode_kernels` (no per-token cache
copies, faster CPU kernels for few rows), whose choices are fixed before the engine samples anything
(kernel_plan.py): settled for the reach it was built with (a run's, keeping a resumed run's recorded plan),
given (a periodic evaluation takes the run's), or planned for the shapes of its first call. Sampling is what
`generate` does for these settings (repetition penalty, temperature, top-k, top-p, min-p, then one
multinomial draw per row), so for one prompt and G = 1 the two give the same
tokens from the same seed (tested; in a batch the random streams part ways once
rows finish). The repetition penalty counts a row's prompt tokens, not its
left padding (as vLLM, which pads nothing; `generate` would penalise the pad token). Stop strings
(`rollout.stop`) end a completion on the token vLLM ends it on (stop.py). Neither takes sampling settings
from the checkpoint's generation config. Without `share_prompt` it
calls `model.generate` with the prompts repeated G times.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cpu.draw import draw_torch
from ..models import left_padded, positions
from . import PlansKernels, Rollout, RunsInLockstep, SamplesTrainingModel, SamplingSettings
from .decode import EagerDecoder, decode_kernels, plan_decode_kernels, reserve_room
from .kernel_plan import KernelPlanning, settle
from .kernels import MIN_DRAW_ELEMENTS
from .static_decode import CompiledForward, StaticDecoder
from .stop import StopStrings

if TYPE_CHECKING:
    from ..distributed import Collectives


@dataclass
class RowSamples:
    """What `HFEngine.sample_rows` returns: one completion per prompt, with the sampler's log-probs."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # per completion token, under the distribution it was drawn from
    finish_reasons: list[str]  # "stop" (EOS, one of the row's stop tokens, a stop string) or "length"


class _Rows:
    """Per-row sampling for `sample_rows`: each row its own random stream (a generator seeded with its seed, as
    `generate` seeds one prompt's group), its own length limit and extra stop tokens, and the log-prob of each
    drawn token under the processed distribution it was drawn from (vLLM's processed_logprobs). Ordinary generate
    calls never build one: their draws and their Rollout are unchanged."""

    def __init__(self, seeds: list[int], limits: list[int], stop_token_ids: list[list[int]]):
        self.seeds = seeds
        self.generators: dict[int, torch.Generator] = {}  # each row's stream, made at its first draw
        self.limits = limits
        self.stops = [set(ids) for ids in stop_token_ids]
        self.logprobs: list[list[float]] = [[] for _ in seeds]

    def _generator(self, row: int, device: torch.device) -> torch.Generator:
        generator = self.generators.get(row)
        if generator is None:
            generator = self.generators[row] = torch.Generator(device).manual_seed(self.seeds[row])
        return generator

    def draw(self, scores: torch.Tensor, live: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]):
        """A token for each live row (`live`: their indices) from its processed `scores` [live, V], each from its
        own stream. Every way gives torch.multinomial's token for the row's generator (cpu/draw.py), so the choice
        is one of speed: torch's own draw on the row's generator where the vocabulary is small (one exponential per
        entry, the rows' divisions batched), else the planned draw of one row with the default CPU generator
        loaded with the row's state (restored afterwards)."""
        probs = checked_probs(scores)
        rows = live.tolist()
        vocab = probs.shape[-1]
        if probs.device.type != "cpu" or vocab < MIN_DRAW_ELEMENTS:
            q = torch.stack(
                [torch.empty_like(probs[0]).exponential_(generator=self._generator(row, probs.device)) for row in rows]
            )
            nxt = (probs / q).argmax(-1)
        else:
            picked = []
            with torch.random.fork_rng(devices=[]):
                for i, row in enumerate(rows):
                    generator = self._generator(row, probs.device)
                    torch.set_rng_state(generator.get_state())
                    picked.append(draw(probs[i : i + 1]))
                    generator.set_state(torch.get_rng_state())
            nxt = torch.cat(picked)
        logp = scores.log_softmax(-1).gather(-1, nxt[:, None]).squeeze(-1).tolist()
        for row, value in zip(rows, logp):
            self.logprobs[row].append(value)
        return nxt


class HFEngine(SamplesTrainingModel, RunsInLockstep, PlansKernels):
    """The training model's own sampler: nothing to push (SamplesTrainingModel); its forwards are collectives
    under FSDP (RunsInLockstep); its decode loop's kernels are planned before it samples (PlansKernels)."""

    def __init__(
        self,
        sampling: SamplingSettings,
        get_model: Callable[[], torch.nn.Module],
        pad_token_id: int,
        share_prompt: bool = True,
        full_parameters: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
        tokenizer=None,
        lockstep: Collectives | None = None,
        compile: str | None = None,
        kernel_plan: Mapping[str, str] | None = None,
        planning: KernelPlanning | None = None,
    ):
        self.get_model = get_model  # returns the plain causal LM (unwrapped), called per generate
        # Context in which a sharded model's parameters are whole (ZeRO-3 gathers them); default: nothing to do.
        self.full_parameters = full_parameters or (lambda model: contextlib.nullcontext())
        self.pad_token_id = pad_token_id
        # The ranks' collectives where every forward is itself a collective (FSDP: each layer's parameters are
        # all-gathered in its forward): then all ranks make the same forward calls, the ranks whose completions
        # ended early idling until the last has finished, as transformers' `synced_gpus`. None: each rank
        # stops when its own completions end (DDP, ZeRO-3 with its hooks removed for sampling, one process).
        self.lockstep = lockstep
        # rollout.hf.compile: the decode step under torch.compile over a static KV cache (static_decode.py), with
        # this torch.compile mode ("default" for torch's default); None: the eager loop with measured kernels.
        self.compile = compile
        self._compiled: CompiledForward | None = None
        # The decode loop's kernel choices (kernel_plan.py), fixed before anything is sampled: `kernel_plan` given,
        # or settled for the run's reach (`planning`, settle_kernels), or planned at the first generate for its shapes.
        self.kernel_plan: dict[str, str] | None = dict(kernel_plan) if kernel_plan is not None else None
        self.planning = planning
        self.eos_token_ids = list(sampling.eos_token_ids)
        self.max_completion_length = sampling.max_completion_length
        self.sampling: dict[str, Any] = dict(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or None,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
        )
        self.batch_size = sampling.batch_size
        self.share_prompt = share_prompt
        self.stop: StopStrings | None = None
        if sampling.stop:
            if tokenizer is None:
                raise ValueError("rollout.stop: the hf engine needs the tokenizer to find stop strings")
            self.stop = StopStrings(sampling.stop, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

    def settle_kernels(self, recorded: Mapping[str, str] | None = None) -> dict[str, str]:
        """The plan for the reach this engine was built with (`planning`), `recorded` kept where it can run here:
        made on the deciding process, taken by every rank (kernel_plan.settle); sampled with from now on."""
        if self.planning is None:
            raise ValueError("settle_kernels: this hf engine was built without the reach to plan for (planning=)")
        reach = self.planning.reach
        self.kernel_plan = settle(
            self.planning, lambda decides: self._plan(reach.rows, reach.context, recorded, decides)
        )
        return dict(self.kernel_plan)

    def widen_kernels(self, max_rows: int, max_context: int) -> None:
        """Extend the plan, on this process alone, to every shape of up to `max_rows` rows and `max_context`
        positions, keeping every choice it holds (so a wider batch never changes the kernel a narrower one runs)."""
        self.kernel_plan = self._plan(max_rows, max_context, self.kernel_plan)

    def _plan(
        self, max_rows: int, max_context: int, recorded: Mapping[str, str] | None = None, decides: bool = True
    ) -> dict[str, str]:
        """decode.plan_decode_kernels for `model`'s shapes up to `max_rows` rows per decode step and `max_context`
        positions (`recorded` kept). Entered by every rank (the parameters are gathered where sharded, a
        collective); where not `decides`, {} without timing anything."""
        if not self.share_prompt:  # `generate` runs transformers' own loop: nothing of ours to choose
            return {}
        model = self.get_model()
        with self.full_parameters(model):
            return plan_decode_kernels(model, max_rows, max_context, recorded=recorded) if decides else {}

    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Any = None) -> None:
        """Nothing to do: this engine samples from the training model itself (the trainer never calls it; the
        keywords are the protocol's)."""

    def close(self) -> None:
        """Nothing held: the weights are the training model's, and the KV cache lives only inside `generate`."""

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[Any] | None = None,
    ) -> Rollout:
        assert episodes is None, "a sampler runs no environment (environments/episodes.py's EpisodeEngine does)"
        model = self.get_model()
        limit = max_tokens or self.max_completion_length
        was_training = model.training
        model.eval()
        use_cache = model.config.use_cache
        model.config.use_cache = True
        # Seeded groups are generated one prompt at a time: generate has one RNG stream per call.
        step = 1 if seeds is not None else self.batch_size or len(prompt_ids) or 1
        starts = list(range(0, len(prompt_ids), step))
        # In lockstep every rank runs as many batches as the busiest one, idling through those it has not.
        batches = len(starts) if self.lockstep is None else self._max_over_ranks(len(starts))
        if self.kernel_plan is None:  # planned now, before this engine samples anything; then fixed
            context = max(map(len, prompt_ids), default=0) + limit
            self.kernel_plan = self._plan(min(step, len(prompt_ids)) * num_generations, context)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        generate = self._decode_shared_prompt if self.share_prompt else self._generate_batch
        try:
            with self.full_parameters(model):
                for batch in range(batches):
                    if batch >= len(starts):
                        generate(model, [], num_generations, limit)  # nothing of ours: keep the others company
                        continue
                    start = starts[batch]
                    with torch.random.fork_rng(devices=[]) if seeds is not None else contextlib.nullcontext():
                        if seeds is not None:
                            torch.manual_seed(seeds[start])
                        c, t = generate(model, prompt_ids[start : start + step], num_generations, limit)
                    completions += c
                    truncated += t
        finally:
            model.config.use_cache = use_cache
            model.train(was_training)
        return Rollout(completion_ids=completions, truncated=truncated)

    @torch.no_grad()
    def sample_rows(
        self,
        prompt_ids: list[list[int]],
        seeds: list[int],
        max_tokens: list[int],
        stop_token_ids: list[list[int]] | None = None,
    ) -> RowSamples:
        """One completion per prompt in one batched decode (the token endpoint's batches, agents/endpoint.py).

        Row i is drawn from its own stream `seeds[i]` (for one row: the tokens `generate([p], 1, seeds=[s])`
        gives; in a batch the same up to the rounding of batched kernels), ends at EOS, at one of
        `stop_token_ids[i]` or a stop string ("stop"), or after `max_tokens[i]` tokens ("length"), and reports
        the log-prob of each token under the processed distribution it was drawn from. The default generator is
        left as it was. Not under lockstep (FSDP): the ranks' endpoints form batches independently."""
        if self.lockstep is not None:
            raise NotImplementedError("the hf engine samples per-row batches only without lockstep (not under FSDP)")
        if not prompt_ids:
            return RowSamples([], [], [])
        rows = _Rows(list(seeds), list(max_tokens), list(stop_token_ids or [[] for _ in prompt_ids]))
        model = self.get_model()
        limit = max(max_tokens)
        was_training = model.training
        model.eval()
        use_cache = model.config.use_cache
        model.config.use_cache = True
        if self.kernel_plan is None:
            self.kernel_plan = self._plan(len(prompt_ids), max(map(len, prompt_ids)) + limit)
        try:
            with self.full_parameters(model):
                tokens, truncated = self._decode_shared_prompt(model, prompt_ids, 1, limit, per_row=rows)
        finally:
            model.config.use_cache = use_cache
            model.train(was_training)
        return RowSamples(tokens, rows.logprobs, ["length" if t else "stop" for t in truncated])

    def _max_over_ranks(self, value: int) -> int:
        if self.lockstep is None:  # this rank alone
            return value
        return int(self.lockstep.max(torch.tensor([value]))[0])

    def _idle_forward(self, model) -> None:
        """A one-token forward whose result nobody reads: under FSDP it makes the same parameter all-gathers
        as the other ranks' real forwards, which is all they wait for."""
        device = next(model.parameters()).device
        model(input_ids=torch.full((1, 1), self.pad_token_id, device=device), use_cache=False)

    def _left_padded(self, model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(model.parameters()).device
        ids, mask = left_padded(prompts, self.pad_token_id)
        return ids.to(device), mask.to(device)

    def _decode_shared_prompt(self, model, prompts: list[list[int]], g: int, limit: int, per_row: _Rows | None = None):
        """Prefill each prompt once, copy its cache G times, sample token by token, drop rows that finished.
        `per_row` (sample_rows, G = 1): each row's own stream, limit and stop tokens."""
        if not prompts:  # only in lockstep, for a batch only other ranks have
            with decode_kernels(model, self.kernel_plan):
                self._idle_forward(model)
                while self._max_over_ranks(0):
                    self._idle_forward(model)
            return [], []
        ids, mask = self._left_padded(model, prompts)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
        rows = torch.arange(len(prompts), device=ids.device).repeat_interleave(g)  # grouped: prompt 0 x G, 1 x G, ...
        cache = out.past_key_values
        occurred = None
        if self.sampling["repetition_penalty"] != 1.0:  # which tokens each row has seen: its prompt's, not padding
            occurred = torch.zeros(len(prompts), out.logits.shape[-1], dtype=torch.int32, device=ids.device)
            occurred.scatter_add_(1, ids, mask.to(torch.int32))
            occurred = (occurred > 0)[rows]
        kernels = decode_kernels(model, self.kernel_plan)
        if self.compile is not None:  # plain modules under torch.compile; only the (exact) draw is chosen here
            cache.reorder_cache(rows)
            decoder: StaticDecoder | EagerDecoder = StaticDecoder(
                self._compiled_forward(model), cache, mask[rows], limit
            )
            context: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            reserve_room(cache, limit)  # new tokens are written in place, not concatenated
            cache.reorder_cache(rows)
            decoder, context = EagerDecoder(model, cache, mask[rows], kernels), kernels
        with context:
            tokens, finished = self._sample_tokens(
                model, decoder, out.logits[rows, -1], mask[rows].sum(-1), occurred, limit, kernels.draw, per_row
            )
        return tokens, [not done for done in finished]

    def _compiled_forward(self, model) -> CompiledForward:
        if self._compiled is None or self._compiled.model is not model:
            self._compiled = CompiledForward(model, self.compile)
        return self._compiled

    def _sample_tokens(
        self,
        model,
        decoder,
        logits: torch.Tensor,
        next_position: torch.Tensor,
        occurred: torch.Tensor | None,
        limit: int,
        draw: Callable[[torch.Tensor], torch.Tensor],
        rows: _Rows | None = None,
    ) -> tuple[list[list[int]], list[bool]]:
        """Token by token from the first `logits` [B, V] through `decoder` (`forward(tokens, positions)`,
        `keep(rows)`), whose rows sit at `next_position` [B]; finished rows leave the batch.
        `occurred` [B, V] marks the tokens each row has seen, for the repetition penalty (None: no penalty).
        Returns each row's tokens and whether it finished (EOS or a stop string) before the length limit.
        `rows` (sample_rows only): per-row streams, limits and stop tokens, and the log-probs it records.

        In lockstep (`self.lockstep`: forwards are collectives) the loop ends when no rank has a row left:
        one all-reduce per token, and a rank whose rows have all finished makes idle forwards until then."""
        eos = torch.tensor(self.eos_token_ids, device=logits.device)
        tokens: list[list[int]] = [[] for _ in range(len(logits))]
        finished = [False] * len(logits)
        live = torch.arange(len(logits), device=logits.device)  # completion index of each row still in the batch
        done_here = False
        for step in itertools.count():
            if not done_here:
                if rows is None:
                    nxt = sample_next_token(logits, **self.sampling, occurred=occurred, draw=draw)  # [live]
                else:
                    settings = {k: v for k, v in self.sampling.items() if k != "do_sample"}
                    nxt = rows.draw(processed_scores(logits, **settings, occurred=occurred), live, draw)
                if occurred is not None:
                    occurred[torch.arange(len(nxt), device=nxt.device), nxt] = True
                going = ~torch.isin(nxt, eos)
                flags = going.tolist()
                for i, (row, token) in enumerate(zip(live.tolist(), nxt.tolist())):
                    tokens[row].append(token)
                    if flags[i] and rows is not None and token in rows.stops[row]:
                        flags[i] = False
                    if flags[i] and self.stop is not None and self.stop.completes_stop(tokens[row]):
                        flags[i] = False
                    finished[row] = not flags[i]
                    if flags[i] and rows is not None and len(tokens[row]) >= rows.limits[row]:
                        flags[i] = False  # its own limit: truncated, not finished
                if self.stop is not None or rows is not None:
                    going = torch.tensor(flags, device=going.device)
                done_here = step >= limit - 1 or not going.any()
            if not (self._max_over_ranks(not done_here) if self.lockstep is not None else not done_here):
                break
            if done_here:
                self._idle_forward(model)
                continue
            if not going.all():  # finished rows leave the batch: no more compute spent on padding
                keep = going.nonzero().squeeze(-1)
                decoder.keep(keep)
                live, nxt, next_position = live[keep], nxt[keep], next_position[keep]
                occurred = occurred[keep] if occurred is not None else None
            logits = decoder.forward(nxt, next_position)
            next_position = next_position + 1
        return tokens, finished

    def _generate_batch(self, model, prompts: list[list[int]], g: int, limit: int):
        from transformers import GenerationConfig

        idle = not prompts  # only in lockstep, for a batch only other ranks have: a stand-in prompt, dropped
        ids, mask = self._left_padded(model, prompts or [[self.pad_token_id]])
        # Only our settings: `generate` fills every setting left unset from the checkpoint's generation
        # config (Qwen2.5-Instruct ships top_k 20 and repetition_penalty 1.05), which would change the
        # distribution the completions are drawn from. So the checkpoint's is swapped out for the call.
        config = GenerationConfig(
            max_new_tokens=limit,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            num_return_sequences=g,  # rows come out grouped: prompt 0 x G, prompt 1 x G, ...
            **{**self.sampling, "top_k": self.sampling["top_k"] or 0, "min_p": self.sampling["min_p"] or None},
        )
        checkpoint_config, model.generation_config = model.generation_config, GenerationConfig()
        try:
            # In lockstep, transformers' own: finished ranks keep stepping until every rank is done.
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                synced_gpus=True if self.lockstep is not None else None,
            )
        finally:
            model.generation_config = checkpoint_config
        if idle:
            return [], []
        new_tokens = out[:, ids.shape[1] :].cpu()  # [B*G, <=L]
        eos = torch.tensor(self.eos_token_ids)
        completions, truncated = [], []
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            hits = torch.isin(new_tokens[row], eos).nonzero()
            length = int(hits[0]) + 1 if len(hits) else len(tokens)  # keep the EOS: it is trained on too
            # A stop string ends the completion where the token-by-token loop would have stopped it.
            stop_length = self.stop.cut(tokens[:length]) if self.stop is not None else None
            completions.append(tokens[: stop_length or length])
            truncated.append(not len(hits) and stop_length is None)
        return completions, truncated


def processed_scores(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    occurred: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores [B, V] (float32) a token is drawn from, `logits` [B, V] after `generate`'s processors: repetition
    penalty (on the tokens marked in `occurred` [B, V]), temperature, top-k, top-p, min-p (filtered: -inf).
    Their log-softmax is the log-prob of the distribution the token is drawn from (vLLM's processed_logprobs)."""
    scores = logits.float()
    if repetition_penalty != 1.0 and occurred is not None:
        penalised = torch.where(scores < 0, scores * repetition_penalty, scores / repetition_penalty)
        scores = torch.where(occurred, penalised, scores)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1)  # ascending: the tail that nucleus sampling drops comes first
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    if min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -float("inf"))
    return scores


def checked_probs(scores: torch.Tensor) -> torch.Tensor:
    """softmax(`scores`), refused when not finite."""
    probs = scores.softmax(-1)
    # A softmax row holds a NaN exactly when its sum does (its entries are in [0, 1] otherwise); summing makes no
    # vocabulary-sized boolean tensor, as isfinite over the whole vocabulary would, on every decode step.
    if not torch.isfinite(probs.sum(-1)).all():
        raise FloatingPointError("sampling: the model's next-token distribution is not finite (NaN or inf logits)")
    return probs


def sample_next_token(
    logits: torch.Tensor,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    occurred: torch.Tensor | None = None,
    draw: Callable[[torch.Tensor], torch.Tensor] = draw_torch,
) -> torch.Tensor:
    """One token per row of `logits` [B, V], as `generate` samples: repetition penalty (on the tokens marked in
    `occurred` [B, V]), temperature, top-k, top-p, min-p, then a multinomial draw (`draw`: any of cpu/draw.py's,
    which all give torch.multinomial's token). vLLM applies the same penalty and min-p (alone: config refuses
    min-p with top-k/top-p, where the two orders differ)."""
    scores = processed_scores(logits, temperature, top_p, top_k, min_p, repetition_penalty, occurred)
    if not do_sample:
        return scores.argmax(-1)
    return draw(checked_probs(scores))
