"""What makes a weight push to the vLLM servers fail loudly: its deadline, and the probe that proves it landed.

- **Deadline** (`rollout.vllm_server.push_timeout`; None: `default_push_timeout`, 60 s + the pushed bytes at
  25 MiB/s). The whole data plane of one push (the gloo or NCCL broadcast with the servers' reload, the disk
  write and reload, a LoRA adapter's load) runs in a daemon worker of `deadline.UserCalls`, the trainer's one
  deadline utility: a push past its limit is abandoned (a thread blocked in a collective cannot be interrupted,
  and NCCL's has no timeout of its own) and the run stops with `PushFailed`, one line naming the servers, the
  method and the version (the step). The gloo group is also opened with the push's limit as its own timeout, so
  a broadcast blocked on either side fails by itself within it, even on a server whose trainer stays alive.
- **Probe** (`rollout.vllm_server.push_probe`, on unless set to false). After every push, each server scores a
  fixed probe of `PROBE_LENGTH` token ids (`prompt_logprobs`: the log-prob of every probe token after the ones
  before it, at temperature 1, where vLLM's processed and raw log-probs agree) and the trainer scores the same
  tokens with the weights it pushed (one forward of 8 tokens). The mean absolute difference must be within the
  tolerance of the weights' dtype (`tolerance`); else `PushFailed` names the server, the method, the version
  and both numbers, and the server's weight version is set to "incomplete push" so that nothing samples from it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import PushFailed

FLOOR_S = 60.0  # the deadline's floor: the group's set-up at the first push, HTTP round trips, a busy server's pause
BANDWIDTH = 25 * 2**20  # bytes/s assumed: a quarter of what a push measured on 2 shared CPU cores (docs/vllm.md)
PROBE_LENGTH = 8
# Mean |log p_server - log p_trainer| over the probe's tokens, in nats, by the dtype the weights are in (the
# looser one when trainer and server differ). float32: both sides compute in float32 and differ by kernel
# rounding only (measured: ~1e-5 on the tests' model, 3e-5 on SmolLM2-135M; the vLLM tests' atol is 2e-4).
# 16-bit: every matmul rounds to 8 (bfloat16) or 11 (float16) significant bits (docs/vllm.md: 5e-3 nats measured
# with vLLM in bfloat16 on the tests' model: a 20x margin there, less on deeper models; float16 is an estimate). Wrong weights (a tensor corrupted, a layer not loaded, the previous model) move the
# probe's log-probs by far more (0.1-10 nats in the tests); a single small optimizer step may not, in 16 bits:
# the weight version, not the probe, says which step a server holds.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 0.05, torch.bfloat16: 0.1}
DEFAULT_TOLERANCE = 0.1  # any other dtype (e.g. fp8): the 16-bit limit


__all__ = ["PushFailed"]  # defined with the package's other faults; raised here


def pushed_bytes(metadata: list[Any]) -> int:
    """The bytes one push moves: every declared tensor (weight_sync.ParamMeta) once."""
    total = 0
    for meta in metadata:
        n = meta.dtype.itemsize
        for d in meta.shape:
            n *= int(d)
        total += n
    return total


def default_push_timeout(nbytes: int) -> float:
    """60 s + bytes / 25 MiB/s: 80 s for a 0.5 GiB model, ~10 min for 7B parameters in bfloat16."""
    return FLOOR_S + nbytes / BANDWIDTH


def tolerance(*dtypes: torch.dtype | None) -> float:
    """The probe's limit for weights held in these dtypes (the trainer's, the server's when known): the loosest."""
    return max(TOLERANCE.get(d, DEFAULT_TOLERANCE) for d in dtypes if d is not None)


def probe_tokens(vocab_size: int) -> list[int]:
    """The probe: `PROBE_LENGTH` fixed token ids spread over the first 100 ids (every tokenizer's own, the smallest
    test tokenizer's included; never one past the vocabulary)."""
    span = max(1, min(vocab_size, 100))
    return [(11 + 37 * i) % span for i in range(PROBE_LENGTH)]


def vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings()
    return int(getattr(embeddings, "num_embeddings", 0) or embeddings.weight.shape[0])


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """log p(token i | tokens < i) for i >= 1 under `model` as it is (a LoRA model with its adapters: what a merged
    push sends), at temperature 1, in eval mode (no dropout); the model's training flag is put back."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([tokens], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        return [float(v) for v in logp.cpu()]
    finally:
        model.train(was_training)


def probe_body(model_name: str, tokens: list[int]) -> dict[str, Any]:
    """The one request per server: score the probe's tokens (`prompt_logprobs: 0`: each token's own log-prob), with
    neutral sampling settings (the server fills missing ones from the checkpoint's generation config)."""
    return {
        "model": model_name,
        "prompt": [tokens],
        "max_tokens": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "prompt_logprobs": 0,
        "seed": 0,
    }


def server_logprobs(answer: list[Any], tokens: list[int]) -> list[float]:
    """The probe's log-probs from a `/v1/completions` answer's `prompt_logprobs` (None for the first token, then one
    {token id: {"logprob": ...}} per token); ValueError if a token is missing."""
    out = []
    for token, entry in zip(tokens[1:], answer[1:], strict=True):
        item = (entry or {}).get(str(token))
        if item is None:
            raise ValueError(f"no log-prob for probe token {token} in {entry!r}")
        out.append(float(item["logprob"] if isinstance(item, dict) else item))
    return out


def mismatch(theirs: list[float], ours: list[float]) -> tuple[float, float]:
    """(mean, max) absolute difference."""
    diffs = [abs(a - b) for a, b in zip(theirs, ours, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)
