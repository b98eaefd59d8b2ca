"""What the token endpoint asks of an engine: one batched call, one completion per request, with log-probs.

`TokenSampler.sample(requests)` takes the requests the endpoint gathered and returns one `TokenResult` each, in
order. A request carries no sampling settings but its length limit and stop tokens: the engine samples at the run's
settings (temperature, top-p, ...), which is how the endpoint overrides what an agent asks for. Each request's
tokens are a function of its prompt and its `seed` alone (the endpoint derives the seed from the run's seed, the
step, the episode and the request's position in it), so how requests were batched changes nothing but the time.

`HFTokenSampler` serves the hf engine (`HFEngine.sample_rows`: one decode, each row its own stream).
`EngineTokenSampler` serves any engine whose `generate` reports sampler log-probs (vllm_colocate, vllm_server):
the requests of a batch with the same `max_tokens` go in one `generate(prompts, 1, seeds=..., max_tokens=...)`, each
prompt drawn from its own seed (the engines' rule), and a request's own stop tokens cut its completion after the
first one (its tokens up to there are what a request stopping there would have drawn: each is drawn from the
request's own seeded stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..rollout import RolloutEngine
    from ..rollout.hf import HFEngine


@dataclass(frozen=True)
class TokenRequest:
    prompt_ids: list[int]
    max_tokens: int  # >= 1, already capped by the episode's budget and the context length
    seed: int
    stop_token_ids: tuple[int, ...] = ()  # besides the run's EOS tokens


@dataclass
class TokenResult:
    completion_ids: list[int]
    logprobs: list[float]  # one per completion token, under the distribution it was drawn from
    finish_reason: str  # "stop" | "length"


class TokenSampler(Protocol):
    @property
    def max_model_len(self) -> int:
        """Prompt + completion positions the policy takes."""

    @property
    def max_batch(self) -> int:
        """Requests per `sample` call at most."""

    def sample(self, requests: list[TokenRequest]) -> list[TokenResult]:
        """One result per request, in order (blocking; called from one thread at a time)."""


class HFTokenSampler:
    """The hf engine behind the endpoint. Its decode kernel plan is extended, before the first request, to every
    batch size up to `max_batch` (choices the plan already holds are kept), so a batch's size never picks a kernel
    that rounds differently from the one a lone request runs."""

    def __init__(self, engine: HFEngine, max_model_len: int | None = None, max_batch: int = 64):
        from ..models import context_length

        self.engine = engine
        self.max_model_len = max_model_len or context_length(engine.get_model()) or 2048
        self.max_batch = max_batch
        self.vocab_size = engine.get_model().get_input_embeddings().num_embeddings  # ids the policy can sample
        self._planned = False

    def sample(self, requests: list[TokenRequest]) -> list[TokenResult]:
        if not self._planned:
            recorded = self.engine.kernel_plan
            self.engine.use_kernels(self.engine.plan_kernels(self.max_batch, self.max_model_len, recorded=recorded))
            self._planned = True
        out = self.engine.sample_rows(
            [r.prompt_ids for r in requests],
            seeds=[r.seed for r in requests],
            max_tokens=[r.max_tokens for r in requests],
            stop_token_ids=[list(r.stop_token_ids) for r in requests],
        )
        return [
            TokenResult(ids, logprobs, reason)
            for ids, logprobs, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons)
        ]


class EngineTokenSampler:
    """Any engine behind the endpoint, through its `generate` (see the module docstring). The engine must report
    sampler log-probs (`Rollout.sampling_logprobs`): the endpoint answers with them, and they are trained with."""

    def __init__(
        self,
        engine: RolloutEngine,
        eos_token_ids: list[int],
        max_model_len: int,
        max_batch: int = 64,
        vocab_size: int | None = None,
    ):
        self.engine = engine
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.vocab_size = vocab_size  # the policy's rows, where it has more than the tokenizer's (None: unknown)

    def sample(self, requests: list[TokenRequest]) -> list[TokenResult]:
        out: list[TokenResult | None] = [None] * len(requests)
        for limit in sorted({r.max_tokens for r in requests}):
            rows = [k for k, r in enumerate(requests) if r.max_tokens == limit]
            rollout = self.engine.generate(
                [requests[k].prompt_ids for k in rows], 1, seeds=[requests[k].seed for k in rows], max_tokens=limit
            )
            if rollout.sampling_logprobs is None:
                raise RuntimeError(f"{type(self.engine).__name__} reports no sampler log-probs: it cannot serve agents")
            for k, ids, logprobs in zip(rows, rollout.completion_ids, rollout.sampling_logprobs):
                stops = self.eos_token_ids | set(requests[k].stop_token_ids)
                end = next((n + 1 for n, t in enumerate(ids) if t in stops), None)
                if end is not None:
                    out[k] = TokenResult(list(ids[:end]), list(logprobs[:end]), "stop")
                else:
                    out[k] = TokenResult(list(ids), list(logprobs), "length")
        return [r for r in out if r is not None]
