"""The hf engine's decode loop kernels: no per-token copies, and of each exact alternative the faster here.

A profile of SmolLM2-135M's decoding (30 layers, 9 query heads sharing 3 key/value heads; docs/performance.md)
showed a large share of the time going to copying the KV cache, not to computing with it:

* `DynamicCache` grows each layer's keys and values with `torch.cat`, which copies the whole cache
  on every token (quadratic in the completion length). `reserve_room` swaps its layers for ones
  that write each new token into room set aside after the prefill.
* With a padding mask, transformers' SDPA path repeats every key/value head for each query head it
  serves (`repeat_kv`) before calling the kernel: another copy of the whole cache per layer per
  token. For a single-token query the `grouped` attention folds the query heads of a group into
  the query-length axis instead, so each key/value head is read once, in place.

Then there are alternatives that compute the same products with different kernels, whose speed depends
on the machine. `DecodeKernels` picks one of each per shape before the run samples: by rule where they round
differently (the linear forms, the attention paths: `DecodeKernels.preferred`), by timing where they give the
same bits (the draws); kernels.py says why:

* linear form: `weight_stationary`, (W @ x^T)^T, which on some CPUs reads the weights faster than
  `nn.Linear`'s x @ W^T does for a few rows; `linear`, `nn.Linear`'s own; or `onednn_packed`, oneDNN on weights
  reordered once per decode loop (float32 only), where the BLAS's few-row products read the weights well below
  the memory's rate. The output is made contiguous: a transposed one sent the attention after it down SDPA's
  slow "math" path (the flash kernel wants a unit stride on the head dimension).
* attention for one-token queries: `grouped` (folded heads, SDPA), `repeated` (transformers' own SDPA
  path), `grouped_matmul` (folded heads, two matmuls and a softmax: no kernel selection at all), `native`
  (folded heads in one C loop: cpu/attention.py). `native` where a step reads enough of the KV cache and it
  builds here, else `grouped` (`DecodeKernels.preferred`).
* the multinomial draw: cpu/draw.py.
* the step of a plain Llama: `modules` (its forward, or llama_step.LlamaDecodeStep: the same bits) or `fused`
  (llama_step.FusedLlamaDecodeStep: the small operators between the linears as one C call each, cpu/layer_ops.py;
  it attends with the native kernel whatever the attention decision says). `fused` where the model's float32
  linears are worth it (`DecodeKernels.preferred`).

The CPU-specific alternatives (the linear forms, the draws) live in grpo_trainer/cpu/, with the torch
internals they rely on and their checks; this module only chooses among them by the plan.

Every alternative is tested against transformers' own decode (tests/test_rollout.py, forced through
`GRPO_TRAINER_DECODE_KERNELS`). All of this is used only inside `HFEngine`'s decode loop; training forwards
are untouched.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cpu import attention, layer_ops
from ..cpu.draw import DRAWS, available_draws, draw_torch
from ..cpu.linear import LINEAR, available_linears, drop_packed_weights
from . import kernels, llama_step
from .kernels import KernelTable, length_bucket, row_bucket

DECODE_ATTENTION = "grpo_trainer_decode_sdpa"
logger = logging.getLogger(__name__)


class ReservedLayer(DynamicLayer):
    """One layer's keys and values in a buffer with room for `room` more tokens: appending writes, never copies.

    `keys`/`values` are views of the filled part, as `DynamicLayer` exposes them. Only what the decode
    loop calls is supported: `update`, `get_seq_length`, `get_mask_sizes` (inherited) and `reorder_cache`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        batch, heads, length, dim = keys.shape
        self._key_buffer = keys.new_empty(batch, heads, length + room, dim)
        self._value_buffer = values.new_empty(batch, values.shape[1], length + room, values.shape[-1])
        self._key_buffer[:, :, :length] = keys
        self._value_buffer[:, :, :length] = values
        self.length = length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.ensure_room(key_states.shape[-2])
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def ensure_room(self, tokens: int) -> None:
        """Raise unless `tokens` more positions fit in the reserved room."""
        if self.length + tokens > self._key_buffer.shape[-2]:
            raise RuntimeError(
                f"KV cache room exhausted: {self.length + tokens} tokens, room for {self._key_buffer.shape[-2]}"
            )

    def advance(self, tokens: int) -> None:
        """Count `tokens` positions written into the room directly (the fused decode step writes them itself)."""
        self.ensure_room(tokens)
        self.length += tokens
        self._expose()

    def rewind(self, tokens: int) -> None:
        """Forget the last `tokens` positions (they are written again by the next update)."""
        self.length -= tokens
        self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep (or repeat) the rows `beam_idx`: the only copy, made when rows finish, not per token."""
        self._key_buffer = self._key_buffer.index_select(0, beam_idx)
        self._value_buffer = self._value_buffer.index_select(0, beam_idx)
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("ReservedLayer serves the decode loop only")


def reserve_room(cache: DynamicCache, room: int) -> bool:
    """Give every layer of a prefilled `cache` room for `room` more tokens; False (cache untouched) if its
    layers are not all plain `DynamicLayer`s (sliding-window or quantized caches keep their own logic)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return False
    cache.layers = [ReservedLayer(layer.keys, layer.values, room) for layer in layers]
    return True


def reserved(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` is a ReservedLayer (rewindable, written in place)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is ReservedLayer for layer in layers)


class EagerDecoder:
    """The decode loop's forward on the eager model: KV cache with reserved room, padding mask grown a column a
    token (the compiled alternative is static_decode.StaticDecoder, with the same two methods).

    For a plain Llama (llama_step.supports) the step runs through `LlamaDecodeStep`: the same operators without
    the module machinery. The model's first decode step in this process runs both ways from the same cache, and
    the lean step is kept only where its logits are the forward's bits (otherwise: one line, and the forward).
    Where `kernels` (the loop's DecodeKernels) plan the `fused` step, `FusedLlamaDecodeStep` runs instead (it
    rounds differently, so it comes from the plan's rule, never from a comparison)."""

    def __init__(
        self, model: torch.nn.Module, cache: DynamicCache, mask: torch.Tensor, kernels: DecodeKernels | None = None
    ):
        self.model, self.cache, self.mask = model, cache, mask
        self.fused = _fused_step(model, cache) if kernels is not None and kernels.step() == "fused" else None
        usable = self.fused is None and reserved(cache) and llama_step.checked(model) is not False
        self.lean = llama_step.LlamaDecodeStep(model) if usable and llama_step.supports(model) else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [live, V] after the live rows' next `tokens` [live] at `positions` [live]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], 1)
        ids, positions = tokens[:, None], positions[:, None]
        if self.fused is not None:
            return self.fused(ids, self.mask, positions, self.cache)
        if self.lean is None:
            return self._forward(ids, positions)
        if llama_step.checked(self.model) is None:
            return self._first_step_both_ways(ids, positions)
        return self.lean(ids, self.mask, positions, self.cache)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache, use_cache=True
        ).logits[:, -1]

    def _first_step_both_ways(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.lean is not None
        expected = self._forward(ids, positions)
        self._rewind(ids.shape[1])
        same = torch.equal(self.lean(ids, self.mask, positions, self.cache), expected)
        llama_step.record(self.model, same)
        if not same:
            logger.info("decode loop: the lean Llama step does not give the forward's bits here; the forward runs")
            self.lean = None
            self._rewind(ids.shape[1])
            expected = self._forward(ids, positions)  # the cache as the forward writes it
        return expected

    def _rewind(self, tokens: int) -> None:
        for layer in self.cache.layers:
            layer.rewind(tokens)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep the live rows `indices`: the cache's only copy, made when rows finish, not per token."""
        self.cache.reorder_cache(indices)
        self.mask = self.mask[indices]


_FUSED_REFUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models already told why not (one line each)


def _fused_step(model: torch.nn.Module, cache: DynamicCache) -> llama_step.FusedLlamaDecodeStep | None:
    """The planned fused step for `model`, or None (and once per model one line) where it cannot run on this loop:
    a forward hook, training mode, not float32 on CPU, a cache without reserved room, the kernels not built here."""
    ops = layer_ops.layer_ops()
    every_layer = reserved(cache) and len(cache.layers) == model.config.num_hidden_layers
    if ops is not None and every_layer and llama_step.FusedLlamaDecodeStep.fits(model):
        return llama_step.FusedLlamaDecodeStep(model, ops)
    if model not in _FUSED_REFUSED:
        _FUSED_REFUSED.add(model)
        logger.info("decode loop: the plan's fused Llama step cannot run on this model or cache here; its modules run")
    return None


def grouped_attention(query, key, value, attention_mask, scaling):
    """SDPA without `repeat_kv`: query [B, H, 1, D], key/value [B, Hkv, L, D]; query head h reads key/value
    head h // (H / Hkv), so the H / Hkv query heads of one group become that group's "query positions"
    [B, Hkv, H/Hkv, D]. All sit at the same position, so the [B, 1, 1, L] padding mask applies to each unchanged."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim)


def grouped_matmul_attention(query, key, value, attention_mask, scaling):
    """The same folded attention as two matmuls and a softmax (no SDPA kernel selection, no padding of blocks)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(folded, key.transpose(-1, -2)) * (dim**-0.5 if scaling is None else scaling)  # [B, Hkv, g, L]
    if attention_mask is not None:
        scores = (
            scores.masked_fill(~attention_mask, -float("inf"))
            if attention_mask.dtype == torch.bool
            else scores + attention_mask
        )
    return torch.matmul(scores.softmax(-1), value).reshape(batch, heads, 1, dim)


def repeated_attention(query, key, value, attention_mask, scaling):
    """transformers' own path: every key/value head repeated for the query heads it serves, then SDPA."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)


def native_grouped_attention(query, key, value, attention_mask, scaling):
    """The folded attention in one C loop (cpu/attention.py), where it takes these tensors; else `grouped`."""
    if attention.runs(query, key, value, attention_mask):
        return attention.native_attention(query, key, value, attention_mask, scaling)
    return grouped_attention(query, key, value, attention_mask, scaling)


ATTENTION = {
    "grouped": grouped_attention,
    "repeated": repeated_attention,
    "grouped_matmul": grouped_matmul_attention,
    "native": native_grouped_attention,
}


INCUMBENT = {"linear": "weight_stationary", "attention": "grouped", "draw": "torch", "step": "modules"}
ROUNDS_DIFFERENTLY = {"linear", "attention", "step"}  # decided by rule, never by timing; the draws are exact


class DecodeKernels:
    """The decode loop's kernels for one model, each looked up in a plan made before the run sampled anything
    (`plan_decode_kernels`; kernels.py says why). A shape the plan lacks runs the incumbent: nothing is timed
    here, so nothing here can change what a run samples.

    As a context manager it puts them in place: every plain `nn.Linear` on CPU (not subclasses: quantized or
    LoRA layers keep their own forward) computes the chosen form for its shape and row count, and the model's
    attention runs through `decode_attention` where it used transformers' SDPA. Everything is restored on exit,
    also on error.
    """

    def __init__(self, model: torch.nn.Module, plan: Mapping[str, str] | None = None):
        self.model = model
        self.plan = dict(plan or {})
        self.linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
        self.by_shape: dict[tuple[int, ...], list[torch.nn.Linear]] = {}  # by (out, in) features
        for module in self.linears:
            self.by_shape.setdefault(tuple(module.weight.shape), []).append(module)
        self.forms: dict[tuple[int, int, int], Callable] = {}  # (out, in, row bucket) -> chosen form
        self.attention_paths: dict[tuple[int, ...], Callable] = {}
        self.draws: dict[tuple[int, int], Callable] = {}
        self.chosen: dict[str, str] = {}  # "decision/shape" -> alternative, as used so far (for reports)
        config = getattr(model, "config", None)
        self.layers = getattr(config, "num_hidden_layers", 1) or 1
        self.switch_attention = getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(
            model, "set_attn_implementation"
        )

    def _lookup(self, decision: str, shape: tuple[int, ...]) -> str:
        """The plan's choice; where it has none, a forced one (GRPO_TRAINER_DECODE_KERNELS), else the incumbent."""
        key = plan_key(decision, shape)
        name = self.plan.get(key) or kernels.forced_choices().get(decision) or INCUMBENT[decision]
        self.chosen[key] = name
        return name

    # -- in the loop

    def linear_form(self, module: torch.nn.Linear, rows: int) -> Callable:
        out_features, in_features = module.weight.shape
        key = (out_features, in_features, row_bucket(rows))
        form = self.forms.get(key)
        if form is None:
            form = self.forms[key] = LINEAR[self._lookup("linear", key)]
        return form

    def attention_path(self, query: torch.Tensor, key: torch.Tensor, attention_mask) -> Callable:
        if query.device.type != "cpu":
            # Measured on CPUs only: on GPUs every rank then runs the same kernels, so ranks that evaluate the
            # same prompts with the same seed (and no lockstep) also make the same forward calls.
            return ATTENTION["grouped"]
        batch, heads, _, dim = query.shape
        kv_heads, length = key.shape[1], key.shape[2]
        shape = (row_bucket(batch), heads, kv_heads, length_bucket(length), dim)
        path = self.attention_paths.get(shape)
        if path is None:
            path = self.attention_paths[shape] = ATTENTION[self._lookup("attention", shape)]
        return path

    def step(self) -> str:
        """How a plain Llama's decode step runs: `modules` (its forward, or the lean step with the same bits:
        llama_step.py) or `fused` (its small operators in C: llama_step.FusedLlamaDecodeStep)."""
        shape = self.step_shape
        return INCUMBENT["step"] if shape is None else self._lookup("step", shape)

    @property
    def step_shape(self) -> tuple[int, int, int] | None:
        """(hidden, intermediate, layers) of a plain Llama on CPU, the one model the `step` decision concerns."""
        if not self.linears or not llama_step.plain_llama(self.model):
            return None
        config = self.model.config
        return (config.hidden_size, config.intermediate_size, config.num_hidden_layers)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of `probs` [B, V], as torch.multinomial(probs, 1) draws it, by the planned exact way."""
        rows, vocab = probs.shape
        if probs.device.type != "cpu":
            return draw_torch(probs)
        shape = (row_bucket(rows), vocab)
        draw = self.draws.get(shape)
        if draw is None:
            name = self._lookup("draw", shape)
            draw = self.draws[shape] = DRAWS[name if name in available_draws() else "torch"]
        return draw(probs)

    # -- planning (before the run samples)

    def alternatives(self, decision: str, shape: tuple[int, ...]) -> list[str]:
        """What can run here for `decision` at `shape`, the incumbent first."""
        if decision == "linear":
            same_shape = self.by_shape.get(shape[:2], [])
            dtype = same_shape[0].weight.dtype if same_shape else torch.float32
            return available_linears(dtype)
        if decision == "attention":
            return [name for name in ATTENTION if name != "native" or attention.attention_library() is not None]
        if decision == "step":
            return ["modules"] + (["fused"] if layer_ops.layer_library() is not None else [])
        return available_draws()

    def reachable(self, max_rows: int, max_context: int) -> list[tuple[str, tuple[int, ...]]]:
        """Every (decision, shape) a decode loop of at most `max_rows` rows and `max_context` positions reaches."""
        config = getattr(self.model, "config", None)
        max_context = min(max_context, getattr(config, "max_position_embeddings", None) or max_context)
        rows = [1 << i for i in range(row_bucket(max(1, max_rows)).bit_length())]  # 1, 2, 4, ... the bucket of max
        lengths = [64 << i for i in range(max(0, length_bucket(max_context).bit_length() - 7) + 1)]  # 64 ... bucket
        found: list[tuple[str, tuple[int, ...]]] = [
            ("linear", (out, in_, r)) for (out, in_) in self.by_shape for r in rows
        ]
        if self.linears and self.switch_attention and config is not None:  # on CPU, where attention is switched
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            if kv_heads != heads:  # no groups to fold: plain SDPA, nothing to choose
                found += [("attention", (r, heads, kv_heads, n, dim)) for r in rows for n in lengths]
        if self.step_shape is not None:
            found.append(("step", self.step_shape))
        vocab = getattr(config, "vocab_size", None)
        if self.linears and vocab:
            found += [("draw", (r, vocab)) for r in rows]
        return found

    def decide(self, decision: str, shape: tuple[int, ...], table: KernelTable, remeasure: bool = False) -> str:
        """This machine's choice for one decision: by rule where the alternatives round differently (the linear
        forms, the attention paths), timed (forced, cached or measured now: KernelTable.decide) where they give
        the same bits (the draws). kernels.py says why."""
        alternatives = self.alternatives(decision, shape)
        if decision in ROUNDS_DIFFERENTLY:
            return kernels.by_rule(decision, alternatives, self.preferred(decision, shape))
        return table.decide(
            "draw",
            shape,
            alternatives,
            lambda: _draw_timings(shape),
            worth_measuring=shape[0] * shape[1] >= kernels.MIN_DRAW_ELEMENTS,
            remeasure=remeasure,
        )

    def preferred(self, decision: str, shape: tuple[int, ...]) -> str | None:
        """The rule for the decisions that change numerics (None: the incumbent). Each fast kernel goes where a
        decode step reads at least `MIN_WORK_BYTES` through it, in float32; smaller models keep today's kernels,
        so the tiny models' runs (the demo, the golden metrics) are the same on every machine.

        Linear: oneDNN's packed form where the float32 weights of that shape are worth it: on the CPU measured, it
        reads the weights 2-3x faster than MKL's few-row products with AVX-512 and 1.2x with AVX2
        (docs/performance.md, "oneDNN's packed linear"), and `available_linears` offers it only where its check
        passes. Attention: the native kernel (cpu/attention.py) where the key/value cache a step reads at this
        shape (rows x key/value heads x context bucket x head size, keys and values, every layer) is worth it and
        the kernel builds here: SmolLM2's 32-row decode step ~9 ms (9%) faster than with grouped SDPA on machine D
        (docs/performance.md); below that, grouped SDPA (its other alternatives were within a few per cent of it
        where measured: near ties are where a timed choice flipped between two fresh caches).

        Step: the fused Llama step where the model's float32 linears read at least `MIN_WORK_BYTES` a step (and
        its kernels build here): SmolLM2's 32-row step 80.7 -> 68.9 ms (best of 30) on machine D (docs/performance.md); below, the
        modules (the tiny models' ~1,300 small operators a step would gain as much, but their golden runs stay)."""
        if decision == "attention":
            rows, _, kv_heads, length, dim = shape
            cache_bytes = rows * kv_heads * length * dim * 2 * 4 * self.layers
            worth = self.dtype == torch.float32 and cache_bytes >= kernels.MIN_WORK_BYTES
            return "native" if worth and "native" in self.alternatives(decision, shape) else None
        if decision == "step":  # the whole model's linears: a step small enough to stay has its operators' cost
            weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in self.linears)
            worth = self.dtype == torch.float32 and weight_bytes >= kernels.MIN_WORK_BYTES
            return "fused" if worth and "fused" in self.alternatives(decision, shape) else None
        if decision != "linear":
            return None
        same_shape = self.by_shape.get(shape[:2], [])
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in same_shape)
        float32 = all(m.weight.dtype == torch.float32 for m in same_shape)
        return "onednn_packed" if float32 and weight_bytes >= kernels.MIN_WORK_BYTES else None

    @property
    def dtype(self) -> torch.dtype:
        return self.linears[0].weight.dtype if self.linears else torch.float32

    # -- in place for the loop

    def __enter__(self) -> DecodeKernels:
        for module in self.linears:
            module.forward = _chosen_linear(self, module)
        if self.switch_attention:
            self.model.set_attn_implementation(DECODE_ATTENTION)
        _active.kernels = self
        return self

    def __exit__(self, *exc) -> None:
        _active.kernels = None
        if self.switch_attention:
            self.model.set_attn_implementation("sdpa")
        for module in self.linears:
            del module.forward
        drop_packed_weights(self.linears)


def plan_key(decision: str, shape: tuple[int, ...]) -> str:
    return f"{decision}/{'x'.join(map(str, shape))}"


def plan_decode_kernels(
    model: torch.nn.Module,
    max_rows: int,
    max_context: int,
    table: KernelTable | None = None,
    recorded: Mapping[str, str] | None = None,
    remeasure: bool = False,
) -> dict[str, str]:
    """The decode loop's plan for `model`: an alternative for every decision a loop of at most `max_rows` rows and
    `max_context` positions reaches, made before anything is sampled (kernels.py says why).

    `recorded`: a run's plan (from its checkpoint): its choices are kept wherever they can run here, whatever
    this machine would choose, and one line is logged for each that cannot; a decision the record has no entry of
    at all is one it predates, and keeps the incumbent (what its run used: the modules of a record made before the
    `step` decision existed). A forced choice
    (`GRPO_TRAINER_DECODE_KERNELS`) wins over both and is logged where it changes a recorded one. The rest
    comes from `table` (this machine's cache; measured now where missing, or everywhere with `remeasure`)."""
    loop = DecodeKernels(model)
    table = table or kernels.default_table()
    recorded = dict(recorded or {})
    forced = kernels.forced_choices()
    plan: dict[str, str] = {}
    todo = loop.reachable(max_rows, max_context)
    measured_before, started = len(table.entries()), time.perf_counter()
    recorded_decisions = {key.split("/")[0] for key in recorded}
    for decision, shape in todo:
        key = plan_key(decision, shape)
        kept = recorded.get(key)
        if kept is None and recorded and decision not in recorded_decisions and decision in ROUNDS_DIFFERENTLY:
            kept = INCUMBENT[decision]  # the record predates this decision: its run used the incumbent
        if kept is not None and decision not in forced:
            if kept in loop.alternatives(decision, shape):
                plan[key] = kept
                continue
            plan[key] = loop.decide(decision, shape, table)
            logger.warning(
                "decode kernels: the run's recorded %s=%s for %s cannot run here; using %s%s",
                decision,
                kept,
                key,
                plan[key],
                "" if decision == "draw" else " (samples differ from the run it continues)",
            )
            continue
        plan[key] = loop.decide(decision, shape, table, remeasure=remeasure)
        if kept is not None and kept != plan[key]:
            logger.warning(
                "decode kernels: %s forces %s=%s where the run recorded %s (samples differ from the run it continues)",
                kernels.FORCE_ENV,
                decision,
                plan[key],
                kept,
            )
    if len(table.entries()) > measured_before:
        logger.info(
            "decode kernels: measured %d choices for this machine in %.0f s (once: cached in %s)",
            len(table.entries()) - measured_before,
            time.perf_counter() - started,
            table.path,
        )
    return plan


def _chosen_linear(loop: DecodeKernels, module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    in_features = module.weight.shape[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return loop.linear_form(module, x.numel() // in_features)(module, x)

    return forward


def _draw_timings(shape: tuple[int, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    probs = torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4, -1)
    return {name: functools.partial(DRAWS[name], probs) for name in available_draws()}


_active = threading.local()  # the DecodeKernels of the loop running in this thread (ranks may be threads in tests)


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The attention function registered for the decode loop: for single-token queries the chosen path,
    anything else (and anything unusual: dropout, attention sinks) transformers' own SDPA function."""
    active = getattr(_active, "kernels", None)
    if query.shape[2] != 1 or dropout or kwargs.get("s_aux") is not None or active is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if key.shape[1] == query.shape[1]:
        path = ATTENTION["repeated"]  # no groups to fold: plain SDPA
    else:
        path = active.attention_path(query, key, attention_mask)
    return path(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def decode_kernels(model: torch.nn.Module, plan: Mapping[str, str] | None = None) -> DecodeKernels:
    """The decode loop's kernels for `model` under `plan`, as a context manager (see DecodeKernels)."""
    return DecodeKernels(model, plan)
