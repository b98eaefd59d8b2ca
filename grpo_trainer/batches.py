"""Phase 3, batches: this rank's completions as micro-batches of tensors -> `TrainBatch`.

CPU only and free of models, so it is tested directly. It reads the step's `TrainingSamples` (samples.py). The
loss mask is the completion's tokens the model wrote (`TrainingSamples.loss_mask`: a multi-turn completion's
tool and environment output carries none). Two more masks meet here:
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

Each mini-batch is then cut into micro-batches (one forward/backward each), and every rank must cut it into
the same number: gradient accumulation, DDP and ZeRO count backward calls. Two ways:
- `train.micro_batch_size`: a fixed number of completions per micro-batch (`micro_batch_rows`).
- `train.micro_batch_tokens` N: as many micro-batches as the most demanding rank needs to keep each under N
  tokens (agreed by a collective), the pieces of a rank spread over them by tokens (`budget_micro_batches`).
  A piece is a prompt with some of its group's completions: a whole group, or, for a group over N, parts of
  it (its prompt then runs once per part).
A rank with less to train than the others fills the count with *filler* micro-batches (a short row, all its
tokens masked: no gradient, no metrics, only the backward call); a mini-batch that no rank trains anything
in (every advantage 0) is marked `idle`: its fillers skip the log-prob passes, and update.py steps the
optimizer on zero gradients without them where the backend allows (not DeepSpeed: it steps inside backward).

Micro-batch tensors come in one of two layouts (models.py): padded, each distinct prompt once and the
completions padded to the longest (`SequenceBatch`), or packed with `train.packing` (`PackedBatch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from .errors import ConfigError
from .models import make_packed_batch, make_sequence_batch, packed_tokens, piece_tokens
from .samples import TrainingSamples


@dataclass
class MicroBatch:
    sequences: dict[str, torch.Tensor]  # the policy's forward arguments (models.SequenceBatch / PackedBatch .tensors)
    mask: torch.Tensor  # [mb, C] 1 on completion tokens that carry loss
    advantages: torch.Tensor  # [mb]
    sampling_logp: torch.Tensor | None = None  # [mb, C] the sampler's own log-probs (vLLM engines)
    old_logp: torch.Tensor | None = None  # [mb, C] filled by the log-prob pass when train.policy_moves_within_step
    # [mb, C] per loss term that scores tokens before the update (the reference's, the teacher's log-probs), by name
    annotations: dict[str, torch.Tensor] = field(default_factory=dict)
    entropy_mask: torch.Tensor | None = (
        None  # [mb, C] 1 on tokens that carry policy gradient (top_entropy_quantile < 1)
    )
    mini_batch: int = 0  # the optimizer step (within one pass over the batch) this micro-batch belongs to
    rows: list[int] = field(default_factory=list)  # this rank's completions in it, in order; empty for a filler

    def to(self, device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        moved["sequences"] = {k: v.to(device) for k, v in self.sequences.items()}
        moved["annotations"] = {k: v.to(device) for k, v in self.annotations.items()}
        return MicroBatch(**moved)


@dataclass
class TrainBatch:
    micro_batches: list[MicroBatch]
    lengths: torch.Tensor  # [rows] model-written tokens of each row on this rank (its completions first)
    trained_completions: int  # rows on this rank that go through the passes (completions, and branches)
    local_tokens: float  # tokens of this rank's kept rows (trained or not): its part of the normaliser
    total_tokens: float = math.nan  # local_tokens summed over ranks (agreed in `build_train_batch`, a collective)
    mini_batch_totals: list[float] = field(
        default_factory=list
    )  # per mini-batch, its tokens summed over ranks (likewise)
    # Per mini-batch, its rows summed over ranks (likewise): the sequence-level normalisers' count. The completions
    # of the mini-batch, plus the further branches of its episodes where an agent's episode branched.
    mini_batch_rows: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # what the log-prob phase measured (entropy selection)
    # Micro-batches of each mini-batch, the same on every rank: the accumulation steps of its optimizer step.
    window_sizes: list[int] = field(default_factory=list)
    # Per mini-batch: no rank trains anything in it (every advantage 0), so it holds fillers only.
    idle: list[bool] = field(default_factory=list)

    def to(self, device) -> TrainBatch:
        return replace(self, micro_batches=[mb.to(device) for mb in self.micro_batches])


class _OneRank:
    """The collectives of a single process."""

    @staticmethod
    def sum(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @staticmethod
    def max(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def build_train_batch(
    samples: TrainingSamples,
    advantages: torch.Tensor,
    pad_token_id: int,
    *,
    micro_batch_size: int | None = None,
    micro_batch_tokens: int | None = None,
    packing: bool = False,
    mask_truncated: bool,
    skip_zero_advantage: bool,
    group_size: int = 1,
    mini_batches: int = 1,
    comm=None,
) -> TrainBatch:
    """This rank's samples; advantages [rows], one per row (`TrainingSamples.per_row`), G completions per group.

    A collective (every rank calls it, with its `comm`; None: one process): the normalisers' token and row totals
    and each mini-batch's micro-batch count are agreed over all ranks."""
    comm = comm or _OneRank()
    local_n = len(samples.completion_ids)
    groups = [c // group_size for c in samples.row_completions]  # the group (this rank's prompt) of each row
    lengths = torch.tensor(samples.model_tokens(), dtype=torch.float32)  # tool output (multi-turn) is not counted
    keep = torch.ones(local_n)
    if mask_truncated:
        keep = 1.0 - torch.tensor(samples.truncated, dtype=torch.float32)
    trainable = None  # None: every completion
    row_weight = keep  # per completion: 0 masks all its tokens out of the loss and the metrics
    if skip_zero_advantage:
        trainable = [j for j in range(local_n) if advantages[j] != 0 and keep[j] > 0 and lengths[j] > 0]
        row_weight = torch.zeros(local_n).index_fill_(0, torch.tensor(trainable, dtype=torch.long), 1.0)
    windows = mini_batch_rows(groups, mini_batches)
    wanted = set(range(local_n) if trainable is None else trainable)
    if micro_batch_tokens is None:
        if micro_batch_size is None:
            raise ValueError("build_train_batch: give micro_batch_size or micro_batch_tokens")
        completions = samples.completions
        plans = [
            _micro_batches_of(rows, micro_batch_size, trainable, lengths, sum(j < completions for j in rows))
            for rows in windows
        ]
        needed = [len(plan) if wanted.intersection(rows) else 0 for rows, plan in zip(windows, plans)]
    else:
        cost = tokens_of(samples.prompt_ids, [len(c) for c in samples.completion_ids], groups, packing)
        plans = [pieces_within([j for j in rows if j in wanted], groups, cost, micro_batch_tokens) for rows in windows]
        needed = [len(first_fit_decreasing(pieces, cost, micro_batch_tokens)) for pieces in plans]
    mini_batch_tokens = [float((lengths * keep)[rows].sum()) for rows in windows]
    # Tokens and rows per mini-batch in one sum over ranks (rows differ between ranks where episodes branched).
    summed = comm.sum(torch.tensor(mini_batch_tokens + [float(len(rows)) for rows in windows]))
    mini_batch_totals = [float(t) for t in summed[: len(windows)]]
    mini_batch_counts = [int(n) for n in summed[len(windows) :]]
    agreed = [int(n) for n in comm.max(torch.tensor(needed, dtype=torch.long))]

    micro_batches = []
    for k, (rows, plan, count) in enumerate(zip(windows, plans, agreed)):
        if micro_batch_tokens is not None:  # an idle mini-batch (count 0) keeps one filler
            plan = budget_micro_batches(plan, max(count, 1), cost, micro_batch_tokens)
        shortest = min(rows, key=lambda j: len(samples.completion_ids[j]))
        for chunk in plan:
            filler = not wanted.intersection(chunk)  # nothing to train: only the backward call counts
            idx = chunk or [shortest]
            weight = torch.zeros(len(idx)) if filler else row_weight[idx]
            micro_batches.append(
                _micro_batch(samples, advantages, idx, weight, pad_token_id, packing, k, rows=[] if filler else idx)
            )
    return TrainBatch(
        micro_batches=micro_batches,
        lengths=lengths,
        trained_completions=local_n if trainable is None else len(trainable),
        local_tokens=float((lengths * keep).sum()),
        total_tokens=float(sum(mini_batch_totals)),
        mini_batch_totals=mini_batch_totals,
        mini_batch_rows=mini_batch_counts,
        window_sizes=[len([mb for mb in micro_batches if mb.mini_batch == k]) for k in range(len(windows))],
        idle=[count == 0 for count in agreed],
    )


def _micro_batch(
    samples: TrainingSamples,
    advantages: torch.Tensor,
    idx: list[int],
    weight: torch.Tensor,
    pad_token_id: int,
    packing: bool,
    mini_batch: int,
    rows: list[int],
) -> MicroBatch:
    """Completions `idx` in the chosen layout. The loss mask covers what the model wrote, times each completion's
    `weight` (0: masked whole, as a truncated completion under DAPO or a filler)."""
    layout = make_packed_batch if packing else make_sequence_batch
    batch = layout([samples.prompt_ids[j] for j in idx], [samples.completion_ids[j] for j in idx], pad_token_id)
    sampled = None
    if samples.sampler_logprobs is not None:
        sampled = _pad([samples.sampler_logprobs[j] for j in idx], batch.num_completion_tokens)
    # Tool output stays in the sequence (attended to) and carries no loss.
    mask = _pad([samples.loss_mask[j] for j in idx], batch.num_completion_tokens)
    return MicroBatch(
        sequences=batch.tensors(),
        mask=mask * weight[:, None],
        advantages=advantages[idx],
        sampling_logp=sampled,
        mini_batch=mini_batch,
        rows=rows,
    )


def mini_batch_rows(groups: list[int], mini_batches: int) -> list[list[int]]:
    """The rows (indices) of each mini-batch, given each row's group (this rank's prompt): whole groups, this rank's
    prompt p in mini-batch p mod M (the same as the global prompt position mod M, since M divides every rank's
    prompt count); within one, group by group, a group's branch rows (after all completions) beside its completions."""
    order = sorted(range(len(groups)), key=lambda j: (groups[j], j))
    return [[j for j in order if groups[j] % mini_batches == k] for k in range(mini_batches)]


def _micro_batches_of(
    rows: list[int], micro: int, trainable: list[int] | None, lengths: torch.Tensor, completions: int
) -> list[list[int]]:
    """`micro_batch_rows` within one mini-batch's rows (`completions` of them completions, the rest further
    branches), mapped back to row indices."""
    wanted = None if trainable is None else set(trainable)
    chosen = None if wanted is None else [i for i, j in enumerate(rows) if j in wanted]
    count = math.ceil(completions / micro)
    return [[rows[i] for i in chunk] for chunk in micro_batch_rows(len(rows), micro, chosen, lengths[rows], count)]


def micro_batch_rows(
    local_n: int, micro: int, trainable: list[int] | None, lengths: torch.Tensor, count: int | None = None
) -> list[list[int]]:
    """The completions (row indices) each micro-batch trains on, `micro` per micro-batch (`train.micro_batch_size`).

    All rows, `micro` at a time, unless `trainable` lists the rows worth a pass. Then those rows are
    spread evenly, in order (groups stay together), over the *same number* of micro-batches: gradient
    accumulation and DDP/ZeRO synchronisation count on every rank making the same number of backward
    calls. A micro-batch left with nothing gets the shortest other row: its advantage is 0 (or its
    tokens masked), and the caller masks all its tokens, so it adds nothing to the gradient or the
    metrics: only the backward call itself is kept.

    `count`: the number of micro-batches, when the rows are more than the completions it was counted from (an
    agent's episodes that branched add rows, not backward calls: the accumulation steps stay what the geometry
    says, on every rank, and the micro-batches grow past `micro` instead; `train.micro_batch_tokens` bounds their
    tokens where that matters).
    """
    n_micro = math.ceil(local_n / micro) if count is None else count
    if trainable is None:
        if local_n <= n_micro * micro:
            return [list(range(start, min(start + micro, local_n))) for start in range(0, local_n, micro)]
        trainable = list(range(local_n))
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


# ----------------------------------------------------------------------------- token budgets

Cost = Callable[[list[int]], int]  # rows -> tokens the model computes for them as one micro-batch


def tokens_of(prompt_ids: list[list[int]], completion_lengths: list[int], groups: list[int], packing: bool) -> Cost:
    """What a micro-batch of these rows costs in tokens through the model, in the layout it will have:
    packed, each distinct prompt once and its completions back to back in rows (`models.packed_tokens`); padded,
    each distinct prompt once padded to the longest, each completion padded to the longest. A group's rows share
    one prompt unless an environment extended them differently or an agent's branch began elsewhere: prompts are
    told apart within a group (`groups`: each row's), as the layouts tell them apart."""
    distinct: dict[tuple[int, tuple[int, ...]], int] = {}
    prompt_of = [distinct.setdefault((g, tuple(p)), len(distinct)) for g, p in zip(groups, prompt_ids)]

    def packed(rows: list[int]) -> int:
        pieces: dict[int, list[int]] = {}
        for j in rows:
            pieces.setdefault(prompt_of[j], []).append(j)
        return packed_tokens(
            [piece_tokens(len(prompt_ids[p[0]]), [completion_lengths[j] for j in p]) for p in pieces.values()]
        )

    def padded(rows: list[int]) -> int:
        if not rows:
            return 0
        prompts = {prompt_of[j]: len(prompt_ids[j]) for j in rows}
        return len(prompts) * max(prompts.values()) + len(rows) * max(completion_lengths[j] for j in rows)

    return packed if packing else padded


def pieces_within(rows: list[int], groups: list[int], cost: Cost, budget: int) -> list[list[int]]:
    """The rows as pieces that each fit `budget`: whole groups (`groups`: each row's), or a group over it cut, in
    order, into parts that fit (each part then carries the prompt). A completion that does not fit with its prompt
    alone is an error."""
    pieces: list[list[int]] = []
    for g in dict.fromkeys(groups[j] for j in rows):
        piece: list[int] = []
        for j in (j for j in rows if groups[j] == g):
            if cost([j]) > budget:
                raise ConfigError(
                    f"train.micro_batch_tokens ({budget}) cannot hold one completion with its prompt ({cost([j])} tokens): "
                    "raise it to at least the longest prompt + rollout.max_completion_length"
                )
            if piece and cost(piece + [j]) > budget:
                pieces.append(piece)
                piece = []
            piece.append(j)
        pieces.append(piece)
    return pieces


def first_fit_decreasing(pieces: list[list[int]], cost: Cost, budget: int) -> list[list[int]]:
    """Pieces into as few micro-batches of at most `budget` tokens as first-fit decreasing finds: how many this
    rank needs."""
    bins: list[list[int]] = []
    for piece in sorted(pieces, key=lambda p: -cost(p)):
        home = next((b for b in bins if cost(b + piece) <= budget), None)
        if home is None:
            bins.append(list(piece))
        else:
            home.extend(piece)
    return [sorted(b) for b in bins]


def budget_micro_batches(pieces: list[list[int]], count: int, cost: Cost, budget: int) -> list[list[int]]:
    """Exactly `count` micro-batches (the most any rank needs, >= what first-fit decreasing found here), each
    under `budget`, balanced by tokens: largest piece first into the lightest micro-batch it fits. Empty ones
    are left for fillers. Should that greedy fail to place a piece, the first-fit bins are used as they are."""
    bins: list[list[int]] = [[] for _ in range(count)]
    for piece in sorted(pieces, key=lambda p: -cost(p)):
        fits = [b for b in bins if cost(b + piece) <= budget]
        if not fits:
            found = first_fit_decreasing(pieces, cost, budget)
            return found + [[] for _ in range(count - len(found))]
        min(fits, key=cost).extend(piece)
    return [sorted(b) for b in bins]


def _pad(rows: list[list[float]] | list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r[:width] + [0.0] * (width - len(r[:width])) for r in rows], dtype=torch.float32)
