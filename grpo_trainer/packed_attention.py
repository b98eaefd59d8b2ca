"""Attention over packed rows, segment by segment: no cost across the segments a packed row holds.

A packed row (models.PackedBatch) holds pieces: a prompt, then its completions back to back. Token q may see token
k <= q of its own piece when k is a prompt token or a token of q's own completion (models.packed_attention_mask).
Computed densely, a row of length L costs L x L scores whatever that mask hides (the CPU's SDPA computes masked
blocks too): a piece of 8 completions of 63 tokens behind a 56-token prompt is ~560 tokens, 313k scores a head, of
which the mask keeps 45k. The linear layers already cost only the real tokens; this module makes attention cost
what each segment costs alone, 62k scores there (SDPA computes a segment's whole query x key rectangle).

Each *segment* is a run of queries with its keys: a prompt (keys: the prompt itself) or a completion (keys: its
prompt, then itself). Laid out as [prefix, own tokens], a segment's query i sees keys 0 .. prefix + i: one
causal band, the same rule for both kinds. Segments of similar sizes are gathered into one padded batch per
*call* (`SegmentLayout.calls`), one SDPA each, and the outputs are gathered back into the row layout; slack (row
padding) gets zeros, which nothing scores and no real token attends to.

Which segments share a call is fixed by the lengths alone (`plan_calls`: longest first, a call closes when its
padding would pass `PADDING_SLACK` of what its segments cost alone), and so is whether the segments are used at all
(`SegmentPlan.pays`: where rows are short, the dense mask computes little more and is faster), so the numbers
depend on the batch, never on timing.
The result equals the dense mask's up to float rounding (the softmax runs over fewer, identical terms: the
masked ones were exactly zero); tests/test_packing.py holds the two to its tolerances.

How it reaches the layers: the layout travels as a keyword argument of the decoder's forward (transformers passes
such arguments down to each layer's attention function), and this module registers transformers' "sdpa" attention
function anew as one that runs the segments when a layout is given and is transformers' own function otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

LAYOUT_KEY = "packed_segments"  # the keyword the layout travels under, from the decoder's forward to each layer
PADDING_SLACK = 0.25  # a call's scores may exceed those of its segments alone by this share
# The segment path pays where the dense mask computes this many times its scores or more. Per score it computes,
# it costs ~1.6x the dense path (its gathers and their backward, smaller SDPA batches) plus ~0.3 ms a call (one
# layer, forward and backward), measured on machine D (docs/performance.md): SmolLM2's recipe ends with rows of
# ~190 tokens, where dense computes 2.2x the segments' scores and was ~9% faster over the update (segments on every
# row, before this rule); its first steps have rows of ~550, 4.5x, where the segments are ~9% faster in a micro-
# batch's forward and backward (2% over the whole update), more as rows grow (attention is quadratic).
SEGMENTS_PAY = 3.0


@dataclass(frozen=True)
class Segment:
    """Queries `own` tokens starting at flat index `own_start` (into the [R * L] row layout), whose keys are
    `prefix` tokens starting at `prefix_start` followed by the queries' own tokens."""

    prefix_start: int
    prefix: int
    own_start: int
    own: int

    @property
    def keys(self) -> int:
        return self.prefix + self.own

    @property
    def area(self) -> int:
        """Query-key scores SDPA computes for this segment alone: every query against every key (the causal band
        within is masked, not skipped)."""
        return self.own * self.keys


def segments_of(piece_ids: list[list[int]], member_ids: list[list[int]]) -> list[Segment]:
    """The segments of packed rows, from the piece and member id of each token (models.PackedBatch): each run of
    one (piece, member) is a prompt (member 0) or a completion of the piece's prompt; slack (piece -1) is none."""
    segments: list[Segment] = []
    for r, (pieces, members) in enumerate(zip(piece_ids, member_ids)):
        width, t = len(pieces), 0
        prompt_start = prompt = 0
        while t < width:
            piece, member, start = pieces[t], members[t], t
            while t < width and pieces[t] == piece and members[t] == member:
                t += 1
            if piece < 0:
                continue
            flat = r * width + start
            if member == 0:
                prompt_start, prompt = flat, t - start
                segments.append(Segment(flat, 0, flat, t - start))
            else:
                segments.append(Segment(prompt_start, prompt, flat, t - start))
    return segments


def plan_calls(segments: list[Segment], slack: float = PADDING_SLACK) -> list[list[int]]:
    """Segments (by index) into calls: longest keys first; a segment joins the open call while the call's scores
    (count x its longest queries x its longest keys) stay within (1 + slack) x what its segments cost alone."""
    order = sorted(range(len(segments)), key=lambda i: (-segments[i].keys, -segments[i].own, i))
    calls: list[list[int]] = []
    real = 0
    for i in order:
        s = segments[i]
        if calls:
            call = calls[-1]
            own = max(s.own, max(segments[j].own for j in call))
            keys = segments[call[0]].keys  # the longest: sorted
            if (len(call) + 1) * own * keys <= (1 + slack) * (real + s.area):
                call.append(i)
                real += s.area
                continue
        calls.append([i])
        real = s.area
    return calls


@dataclass
class SegmentCall:
    """One SDPA over a padded batch of segments: which flat tokens are its queries and keys, and its mask."""

    queries: torch.Tensor  # [S, Q] flat index of each query (padding: index 0, its output dropped)
    keys: torch.Tensor  # [S, K] flat index of each key (prefix, then own tokens; padding: index 0, masked)
    mask: torch.Tensor  # [S, 1, Q, K] True: attend (query i sees keys 0 .. prefix + i; never an empty row)


@dataclass
class SegmentPlan:
    """A packed batch's segments and how they group into calls: lengths only, no tensors, cheap enough to make for
    every packed forward to decide whether the segment path is worth building (`pays`)."""

    rows: int
    width: int
    segments: list[Segment]
    calls: list[list[int]]  # indices into `segments`, one list per SDPA call

    @classmethod
    def of(cls, piece_ids: torch.Tensor, member_ids: torch.Tensor) -> SegmentPlan:
        rows, width = piece_ids.shape
        segments = segments_of(piece_ids.tolist(), member_ids.tolist())
        return cls(rows, width, segments, plan_calls(segments))

    @property
    def scores(self) -> int:
        """Query-key scores the calls compute, each head (padding included)."""
        total = 0
        for call in self.calls:
            group = [self.segments[i] for i in call]
            total += len(group) * max(s.own for s in group) * max(s.keys for s in group)
        return total

    @property
    def pays(self) -> bool:
        """Whether the segment path is worth running rather than the dense mask (SEGMENTS_PAY): a rule on the
        batch's lengths, never on timing, so the same batch always takes the same path (and rounds the same way)."""
        return self.rows * self.width * self.width >= SEGMENTS_PAY * self.scores

    def layout(self) -> SegmentLayout:
        """The index tensors and masks of the calls, on the CPU."""
        calls: list[SegmentCall] = []
        take = torch.full((self.rows * self.width,), -1, dtype=torch.long)
        written = 0
        for members in self.calls:
            group = [self.segments[i] for i in members]
            q_len, k_len = max(s.own for s in group), max(s.keys for s in group)
            queries = torch.zeros(len(group), q_len, dtype=torch.long)
            keys = torch.zeros(len(group), k_len, dtype=torch.long)
            prefixes = torch.tensor([s.prefix for s in group])
            for b, s in enumerate(group):
                own = torch.arange(s.own_start, s.own_start + s.own)
                queries[b, : s.own] = own
                keys[b, : s.prefix] = torch.arange(s.prefix_start, s.prefix_start + s.prefix)
                keys[b, s.prefix : s.keys] = own
                take[own] = written + b * q_len + torch.arange(s.own)
            band = prefixes[:, None, None] + torch.arange(q_len)[None, :, None]  # [S, Q, 1]: the last key visible
            mask = torch.arange(k_len)[None, None, :] <= band  # never empty: key 0 is visible to every query
            calls.append(SegmentCall(queries, keys, mask[:, None]))
            written += len(group) * q_len
        take[take < 0] = written  # slack: the zero row
        return SegmentLayout.assembled(self.rows, self.width, calls, take)


@dataclass
class SegmentLayout:
    """What every layer's attention needs to run a packed batch segment by segment, built once per forward."""

    rows: int
    width: int
    calls: list[SegmentCall]
    # [R * L]: for each flat position, its row in the calls' outputs laid end to end ([sum S * Q] rows, then one
    # of zeros for slack)
    take: torch.Tensor
    query_index: torch.Tensor  # every call's `queries`, flattened and laid end to end
    key_index: torch.Tensor  # every call's `keys`, likewise

    @classmethod
    def of(cls, piece_ids: torch.Tensor, member_ids: torch.Tensor) -> SegmentLayout:
        """The layout of a packed batch, whether or not it pays (SegmentPlan.pays)."""
        return SegmentPlan.of(piece_ids, member_ids).layout()

    @classmethod
    def assembled(cls, rows: int, width: int, calls: list[SegmentCall], take: torch.Tensor) -> SegmentLayout:
        query_index = torch.cat([c.queries.view(-1) for c in calls] + [take.new_zeros(0)])
        key_index = torch.cat([c.keys.view(-1) for c in calls] + [take.new_zeros(0)])
        return cls(rows, width, calls, take, query_index, key_index)

    def to(self, device: torch.device) -> SegmentLayout:
        if self.take.device == torch.device(device):
            return self
        calls = [SegmentCall(c.queries.to(device), c.keys.to(device), c.mask.to(device)) for c in self.calls]
        return SegmentLayout.assembled(self.rows, self.width, calls, self.take.to(device))


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' "sdpa" attention function, as this module registers it: with a packed layout in the keyword
    arguments, attention segment by segment (module docstring); without one, transformers' own SDPA function,
    called exactly as the layer called this one."""
    layout: SegmentLayout | None = kwargs.pop(LAYOUT_KEY, None)
    if layout is None:
        return _SDPA(module, query, key, value, attention_mask, *args, **kwargs)
    if kwargs.get("dropout") or kwargs.get("s_aux") is not None:
        raise ValueError(
            "packed segment attention takes no attention dropout and no attention sinks: set train.packing=false"
        )
    return segment_attention(query, key, value, layout, kwargs.get("scaling")), None


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout, scaling: float | None
) -> torch.Tensor:
    """Attention of packed rows ([R, H, L, D] queries, [R, Hkv, L, D] keys and values), one SDPA per call of the
    layout: [R, L, H, D], as transformers' attention functions return it."""
    rows, heads, width, dim = query.shape
    groups = heads // key.shape[1]
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    flat_k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    flat_v = value.transpose(1, 2).reshape(rows * width, value.shape[1], dim)
    # One gather each for queries, keys and values over all calls, split into the calls' pieces: index_select's
    # backward is one index_add, and split's a concatenation (a gather per call would zero a whole gradient each).
    sizes = [call.queries.numel() for call in layout.calls]
    key_sizes = [call.keys.numel() for call in layout.calls]
    qs = flat_q.index_select(0, layout.query_index).split(sizes)
    ks = flat_k.index_select(0, layout.key_index).split(key_sizes)
    vs = flat_v.index_select(0, layout.key_index).split(key_sizes)
    outputs = []
    for call, q, k, v in zip(layout.calls, qs, ks, vs):
        segments, q_len = call.queries.shape
        k_len = call.keys.shape[1]
        q = q.view(segments, q_len, heads, dim).transpose(1, 2)  # [S, H, Q, D]
        k = k.view(segments, k_len, -1, dim).transpose(1, 2)  # [S, Hkv, K, D]
        v = v.view(segments, k_len, -1, dim).transpose(1, 2)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=call.mask, scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, dim))  # [S * Q, H, D]
    outputs.append(flat_q.new_zeros(1, heads, dim))  # what slack gets
    return torch.cat(outputs).index_select(0, layout.take).view(rows, width, heads, dim)


def runs_segments(model) -> bool:
    """Whether `model`'s attention runs packed rows segment by segment: transformers' SDPA path without attention
    dropout. Otherwise (the eager path) packed rows take the dense mask (models.packed_attention_mask)."""
    config = model.config
    return getattr(config, "_attn_implementation", None) == "sdpa" and not getattr(config, "attention_dropout", 0.0)


def placeholder_mask(rows: int, device: torch.device) -> torch.Tensor:
    """What the decoder gets as its attention mask beside a layout: a 4D mask is taken as prepared (transformers
    builds none), and the segment path reads its masks from the layout."""
    return torch.ones(rows, 1, 1, 1, dtype=torch.bool, device=device)


# transformers' layers look their attention function up by name at every call: "sdpa" becomes `_attention`, which
# is transformers' own function for every call that carries no packed layout (generation, other models, the
# padded layout), so nothing else changes. A layer recomputed under activation checkpointing gets its keyword
# arguments again, the layout included, so the recomputation takes the same path as the forward did.
_SDPA = sdpa_attention_forward  # what transformers registers as "sdpa"
AttentionInterface.register("sdpa", _attention)
