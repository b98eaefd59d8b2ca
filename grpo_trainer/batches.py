"""Phase 3, batches: this rank's completions as micro-batches of padded tensors -> `TrainBatch`.

CPU only and free of models, so it is tested directly. The loss mask is the completion's tokens, less the
tool output of a multi-turn completion (`Rollout.completion_mask`). Two more masks meet here:
`mask_truncated_completions` (DAPO) zeroes completions that hit the length limit,
and, when skipping is exact (beta = 0 and a loss whose normaliser does not count
the tokens present in a micro-batch: `LossVariant.exact_zero_advantage_skip`),
completions that cannot move the weights (advantage 0, or every token masked)
are left out of the forward/backward passes altogether. The normalisers still
count every kept completion, trained or not, so skipping never changes the loss.

With `train.mini_batches` = M > 1, the rows are first dealt into M mini-batches (one optimizer step each) by
prompt: the prompt at position p of the whole batch goes to mini-batch p mod M. Groups stay whole, and since
every rank holds a contiguous slice of prompts whose length M divides, each mini-batch holds the same
completions whatever the number of ranks (and each rank the same number of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from .models import make_sequence_batch
from .rollout import Rollout


@dataclass
class MicroBatch:
    sequences: dict[str, torch.Tensor]  # the policy's forward arguments (models.SequenceBatch.tensors)
    mask: torch.Tensor  # [mb, C] 1 on completion tokens that carry loss
    advantages: torch.Tensor  # [mb]
    sampling_logp: torch.Tensor | None = None  # [mb, C] the sampler's own log-probs (vLLM engines)
    old_logp: torch.Tensor | None = None  # [mb, C] filled by the log-prob pass when num_iterations > 1
    ref_logp: torch.Tensor | None = None  # [mb, C] filled by the log-prob pass when beta > 0
    entropy_mask: torch.Tensor | None = None  # [mb, C] 1 on tokens that carry policy gradient (top_entropy_quantile < 1)
    mini_batch: int = 0  # the optimizer step (within one pass over the batch) this micro-batch belongs to

    def to(self, device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        moved["sequences"] = {k: v.to(device) for k, v in self.sequences.items()}
        return MicroBatch(**moved)


@dataclass
class TrainBatch:
    micro_batches: list[MicroBatch]
    lengths: torch.Tensor  # [local_n] completion lengths on this rank
    trained_completions: int  # completions on this rank that go through the passes
    local_tokens: float  # tokens of this rank's kept completions (trained or not): its part of the normaliser
    mini_batch_tokens: list[float] = field(default_factory=list)  # local_tokens split by mini-batch
    total_tokens: float = math.nan  # local_tokens summed over ranks (set by `count_tokens`, a collective)
    mini_batch_totals: list[float] = field(default_factory=list)  # mini_batch_tokens summed over ranks (likewise)
    metrics: dict[str, float] = field(default_factory=dict)  # what the log-prob phase measured (entropy selection)

    def count_tokens(self, comm) -> None:
        """The normalisers' token counts over all ranks: per mini-batch, and for the whole batch."""
        self.mini_batch_totals = [float(t) for t in comm.sum(torch.tensor(self.mini_batch_tokens))]
        self.total_tokens = float(sum(self.mini_batch_totals))

    def to(self, device) -> TrainBatch:
        return replace(self, micro_batches=[mb.to(device) for mb in self.micro_batches])


def build_train_batch(
    prompt_ids: list[list[int]],
    rollout: Rollout,
    advantages: torch.Tensor,
    pad_token_id: int,
    *,
    micro_batch_size: int,
    mask_truncated: bool,
    skip_zero_advantage: bool,
    group_size: int = 1,
    mini_batches: int = 1,
) -> TrainBatch:
    """prompt_ids[j] is the prompt completion j continues; advantages [local_n], one per completion, G per group."""
    local_n = len(rollout.completion_ids)
    lengths = torch.tensor(rollout.model_tokens(), dtype=torch.float32)  # tool output (multi-turn) is not counted
    keep = torch.ones(local_n)
    if mask_truncated:
        keep = 1.0 - torch.tensor(rollout.truncated, dtype=torch.float32)
    trainable = None  # None: every completion
    row_weight = keep  # per completion: 0 masks all its tokens out of the loss and the metrics
    if skip_zero_advantage:
        trainable = [j for j in range(local_n) if advantages[j] != 0 and keep[j] > 0 and lengths[j] > 0]
        row_weight = torch.zeros(local_n).index_fill_(0, torch.tensor(trainable, dtype=torch.long), 1.0)
    micro_batches, mini_batch_tokens = [], []
    for k, rows in enumerate(mini_batch_rows(local_n, group_size, mini_batches)):
        mini_batch_tokens.append(float((lengths * keep)[rows].sum()))
        for idx in _micro_batches_of(rows, micro_batch_size, trainable, lengths):
            batch = make_sequence_batch([prompt_ids[j] for j in idx], [rollout.completion_ids[j] for j in idx], pad_token_id)
            sampled = None
            if rollout.sampling_logprobs is not None:
                sampled = _pad([rollout.sampling_logprobs[j] for j in idx], batch.num_completion_tokens)
            mask = batch.completion_mask
            if rollout.completion_mask is not None:  # tool output stays in the sequence and carries no loss
                mask = _pad([rollout.completion_mask[j] for j in idx], batch.num_completion_tokens)
            micro_batches.append(
                MicroBatch(
                    sequences=batch.tensors(),
                    mask=mask * row_weight[idx, None],  # [mb, C]
                    advantages=advantages[idx],  # [mb]
                    sampling_logp=sampled,
                    mini_batch=k,
                )
            )
    return TrainBatch(
        micro_batches=micro_batches,
        lengths=lengths,
        trained_completions=local_n if trainable is None else len(trainable),
        local_tokens=float((lengths * keep).sum()),
        mini_batch_tokens=mini_batch_tokens,
    )


def mini_batch_rows(local_n: int, group_size: int, mini_batches: int) -> list[list[int]]:
    """The completions (row indices) of each mini-batch: whole groups, this rank's prompt p in mini-batch p mod M
    (the same as the global prompt position mod M, since M divides every rank's prompt count)."""
    if mini_batches == 1:
        return [list(range(local_n))]
    return [[j for j in range(local_n) if (j // group_size) % mini_batches == k] for k in range(mini_batches)]


def _micro_batches_of(rows: list[int], micro: int, trainable: list[int] | None, lengths: torch.Tensor) -> list[list[int]]:
    """`micro_batch_rows` within one mini-batch's rows, mapped back to row indices."""
    wanted = None if trainable is None else set(trainable)
    chosen = None if wanted is None else [i for i, j in enumerate(rows) if j in wanted]
    return [[rows[i] for i in chunk] for chunk in micro_batch_rows(len(rows), micro, chosen, lengths[rows])]


def micro_batch_rows(local_n: int, micro: int, trainable: list[int] | None, lengths: torch.Tensor) -> list[list[int]]:
    """The completions (row indices) each micro-batch trains on.

    All rows, `micro` at a time, unless `trainable` lists the rows worth a pass. Then those rows are
    spread evenly, in order (groups stay together), over the *same number* of micro-batches: gradient
    accumulation and DDP/ZeRO synchronisation count on every rank making the same number of backward
    calls. A micro-batch left with nothing gets the shortest other row: its advantage is 0 (or its
    tokens masked), and the caller masks all its tokens, so it adds nothing to the gradient or the
    metrics: only the backward call itself is kept.
    """
    n_micro = math.ceil(local_n / micro)
    if trainable is None:
        return [list(range(start, min(start + micro, local_n))) for start in range(0, local_n, micro)]
    sizes = [len(trainable) // n_micro + (1 if i < len(trainable) % n_micro else 0) for i in range(n_micro)]
    chunks, start = [], 0
    for size in sizes:
        chunks.append(trainable[start : start + size])
        start += size
    if any(not chunk for chunk in chunks):
        chosen = set(trainable)
        filler = min((j for j in range(local_n) if j not in chosen), key=lambda j: float(lengths[j]))
        chunks = [chunk or [filler] for chunk in chunks]
    return chunks


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([r[:width] + [0.0] * (width - len(r[:width])) for r in rows], dtype=torch.float32)
