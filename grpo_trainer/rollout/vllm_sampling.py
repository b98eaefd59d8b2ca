"""What both vLLM engines ask vLLM for, and how both read what comes back: one place for each.

`vllm_colocate` passes `sampling_fields(...)` to `vllm.SamplingParams`, `vllm_server` sends the same dict
as the JSON body of `POST /v1/completions` (vLLM's OpenAI server takes the same names), so the two engines
cannot drift apart in what they sample. `request_seed` is the one seeding rule and `cut_completion` the one
EOS/truncation rule.
"""

from __future__ import annotations

from typing import Any

from . import SamplingSettings, mix_seed

SEED_RANGE = 1 << 62  # vLLM's per-request seed must fit a signed 64-bit integer, also after adding n - 1


def request_seed(engine_seed: int | None, call: int, prompt_index: int, n: int, given: int | None = None) -> int | None:
    """The seed of the request that samples prompt `prompt_index` of the engine's `call`-th generate call.

    A caller's per-prompt seed (`given`) wins: the group then depends on that seed alone, not on batching,
    ranks or how many servers share the work. Otherwise it is reproducible from the engine's own seed and
    still differs for every call and every prompt; vLLM draws the n samples of one request from seed,
    seed + 1, ..., seed + n - 1, hence the stride n. No seed at all (None): vLLM's own random stream.
    """
    if given is not None:
        return given % SEED_RANGE
    if engine_seed is None:
        return None
    return mix_seed(engine_seed, call, prompt_index * n) % SEED_RANGE


def sampling_fields(
    sampling: SamplingSettings, n: int, *, seed: int | None, max_tokens: int | None = None, logprobs: bool = True
) -> dict[str, Any]:
    """vLLM's sampling parameters for one request of `n` samples, by vLLM's own names.

    Every control is sent even at its neutral value: vLLM's server fills the ones a request leaves out from
    the checkpoint's generation config (Qwen2.5-Instruct: repetition_penalty 1.05), which the config did not
    ask for. `logprobs: 0` returns the sampled token's log-prob only; the engines start vLLM with
    `processed_logprobs`, so it is the log-prob under the distribution the token was drawn from.
    """
    return {
        "n": n,
        "max_tokens": max_tokens or sampling.max_completion_length,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": list(sampling.eos_token_ids),
        "stop": list(sampling.stop) or None,
        "logprobs": 0 if logprobs else None,
        "seed": seed,
        "skip_special_tokens": False,
    }


def cut_completion(
    token_ids: list[int], logprobs: list[float], eos_token_ids: set[int], finish_reason: str | None
) -> tuple[list[int], list[float], bool]:
    """One sample as the trainer keeps it: (token ids, their log-probs, truncated).

    Up to and including the first EOS (trained on too), nothing after it. A sample that ended on a stop
    string (rollout.stop; vLLM's finish_reason "stop" without EOS) keeps the token that completed it and is
    not truncated; only one that ran into the length limit is.
    """
    hits = [i for i, t in enumerate(token_ids) if t in eos_token_ids]
    if hits:
        return list(token_ids[: hits[0] + 1]), list(logprobs[: hits[0] + 1]), False
    return list(token_ids), list(logprobs), finish_reason != "stop"
