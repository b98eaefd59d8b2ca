"""The decode loop's linear forms for CPU `nn.Linear`s: the same product by different kernels (decode.py chooses
one per shape by the run's kernel plan; rollout/kernels.py measures them).

`weight_stationary` and `linear` are public torch; `onednn_packed` calls oneDNN's private linear ops
(torch_internals.py: `mkldnn_reorder`, `mkldnn_linear`) and is offered only where their check passes and
`GRPO_TRAINER_CPU_PLAIN` does not name `onednn_linear` (paths.py). It sums in another order, so a run whose plan
recorded it and resumes where it is not offered samples differently, and the plan says so.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import paths
from .torch_internals import mkldnn_linear, mkldnn_reorder, weight_stamp


def weight_stationary_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` as (W @ x^T)^T: the same products, the weights streamed as the stationary operand."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(self.weight, rows.t()).t().contiguous()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def plain_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, self.weight, self.bias)


PACKED = "_decode_packed_weight"  # where onednn_packed_linear keeps a module's reordered weights while they live


def onednn_packed_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through oneDNN, the weights reordered once into its blocked layout (as inductor's
    freezing does for CPU linears): the same products summed in another order (outputs within ~1e-6 of their
    size of `nn.Linear`'s). Why: with a few rows a linear is bound by reading its weights, and MKL's `nn.Linear`
    reads them well below the memory's rate on some CPUs, where the blocked layout reads them near it
    (docs/performance.md, "oneDNN's packed linear").

    The reordered copy is kept on the module while its weights are unchanged (same storage and version), and
    dropped when the decode loop ends (DecodeKernels.__exit__): it doubles the linears' memory while it lives,
    and the weights change at every optimizer step anyway."""
    return mkldnn_linear(x, packed_weight(self, max(1, x.numel() // x.shape[-1])), self.bias)


def packed_weight(module, rows: int) -> torch.Tensor:
    """`module.weight` in oneDNN's layout, reordered for `rows` rows when first asked for (oneDNN's choice of
    kernel, and so the last bits of a product, may depend on that hint: a decode loop's first call sets it) and
    kept while the weights are unchanged."""
    stamp = weight_stamp(module.weight)
    packed = module.__dict__.get(PACKED)
    if packed is None or packed[0] != stamp:
        packed = module.__dict__[PACKED] = (stamp, mkldnn_reorder(module.weight, rows))
    return packed[1]


def drop_packed_weights(modules) -> None:
    for module in modules:
        module.__dict__.pop(PACKED, None)


# Linears of one parent module that read the same input, in the order transformers' Llama-family layers call them
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class StackedSiblings:
    """Sibling linears that read the same input (attention's q/k/v, the MLP's gate/up) in the onednn_packed form,
    computed as one product of their stacked weights: one call instead of two or three, each with its own
    overhead (SmolLM2 at 32 rows: 0.19 ms for q/k/v against 0.28 ms; docs/performance.md).

    Only where that gives every member's output bit for bit: a stacked product sums each output over the same
    inputs as the member's own, but a library may block its reduction by the output's width, so equality is
    checked here, once per row count, on a random input, before a stacked product is used for that count; where
    it fails the members compute alone. Whatever runs, the decode loop's numbers are the separate products'.

    The first member's call computes all outputs and keeps them, with its input; each later member called with
    that same tensor (same object, unchanged) takes its own, anything else computes alone (reordered for the
    loop's first rows, as onednn_packed_linear would have reordered it). The stacked, reordered
    weights live while the decode loop does (`drop`); the members' own reordered copies, made for the check, are
    dropped after it."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.sizes = [member.weight.shape[0] for member in members]
        self._stacked: SimpleNamespace | None = None  # what packed_weight reads: weight, bias, its cache
        self._hint = 0  # the rows of the loop's first call: every reordering here is made for them
        self._exact: dict[tuple[int, int], bool] = {}  # (hint, rows) -> the stacked product gives each member's bits
        self._kept: tuple[torch.Tensor, int, list[torch.Tensor]] | None = None  # input, its version, outputs

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member `member`'s output for `x` (onednn_packed_linear's): from the stacked product where it is exact
        and the member reads the input it was computed from, else alone."""
        rows = max(1, x.numel() // x.shape[-1])
        self._hint = self._hint or rows
        if member == 0 and self._is_exact(rows, x.dtype):
            stacked = self._stack()
            outputs = mkldnn_linear(x, packed_weight(stacked, self._hint), stacked.bias).split(self.sizes, -1)
            self._kept = (x, x._version, [out.contiguous() for out in outputs])
            return self._kept[2][0]
        kept, self._kept = self._kept, None if member == len(self.members) - 1 else self._kept
        if member > 0 and kept is not None and kept[0] is x and kept[1] == x._version:
            return kept[2][member]
        alone = self.members[member]  # reordered for the loop's first rows, as it would be without its siblings
        return mkldnn_linear(x, packed_weight(alone, self._hint), alone.bias)

    def drop(self) -> None:
        """At the end of a decode loop: the stacked weights go (the weights change before the next)."""
        self._stacked, self._kept, self._hint = None, None, 0

    def _stack(self) -> SimpleNamespace:
        """The members' weights (and biases) stacked, made again when any member's weights changed."""
        stamps = [weight_stamp(member.weight) for member in self.members]
        if self._stacked is None or self._stacked.stamps != stamps:
            biases = [member.bias for member in self.members]
            self._stacked = SimpleNamespace(
                weight=torch.cat([member.weight.detach() for member in self.members]),
                bias=None if biases[0] is None else torch.cat([b.detach() for b in biases]),
                stamps=stamps,
            )
        return self._stacked

    def _is_exact(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the stacked product gives each member's bits at `rows`, each reordered as the loop alone would
        reorder it (for its first call's rows). Where it does not, the members' reorderings stay for them to use."""
        key = (self._hint, rows)
        if key not in self._exact:
            x = torch.randn(
                rows, self.members[0].weight.shape[1], generator=torch.Generator().manual_seed(rows), dtype=dtype
            )
            stacked = self._stack()
            together = mkldnn_linear(x, packed_weight(stacked, self._hint), stacked.bias).split(self.sizes, -1)
            alone = [mkldnn_linear(x, packed_weight(m, self._hint), m.bias) for m in self.members]
            self._exact[key] = all(torch.equal(a, b) for a, b in zip(alone, together))
            if self._exact[key]:
                drop_packed_weights(self.members)
        return self._exact[key]


def sibling_groups(model: torch.nn.Module, linears: list[torch.nn.Linear]) -> list[list[torch.nn.Linear]]:
    """The `SIBLINGS` of `model` among `linears` that can share a product: same input width, dtype and device,
    all with a bias or none. None where the fast path is off (paths.py: `GRPO_TRAINER_CPU_PLAIN=stacked_linears`)."""
    if not paths.usable("stacked_linears"):
        return []
    candidates = {id(module) for module in linears}
    groups = []
    for parent in model.modules():
        for names in SIBLINGS:
            found = [getattr(parent, name, None) for name in names]
            members = [m for m in found if isinstance(m, torch.nn.Linear) and id(m) in candidates]
            if len(members) < len(names):
                continue
            weights = [m.weight for m in members]
            if (
                len({(w.shape[1], w.dtype, w.device) for w in weights}) == 1
                and len({m.bias is None for m in members}) == 1
            ):
                groups.append(members)
    return groups


LINEAR = {"weight_stationary": weight_stationary_linear, "linear": plain_linear, "onednn_packed": onednn_packed_linear}
FLOAT32_ONLY = {"onednn_packed"}  # oneDNN's bfloat16/float16 linears depend on the CPU's instructions: not offered


def available_linears(dtype: torch.dtype) -> list[str]:
    """The forms that can run here for weights of `dtype`, the incumbent first."""
    return [
        name
        for name in LINEAR
        if (dtype == torch.float32 or name not in FLOAT32_ONLY)
        and (name != "onednn_packed" or paths.usable("onednn_linear"))
    ]
