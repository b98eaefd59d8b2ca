"""The decode loop's linear forms for CPU `nn.Linear`s: the same product by different kernels (decode.py chooses
one per shape by the run's kernel plan; rollout/kernels.py measures them).

`weight_stationary` and `linear` are public torch; `onednn_packed` calls oneDNN's private linear ops
(torch_internals.py: `mkldnn_reorder`, `mkldnn_linear`) and is offered only where their check passes and
`GRPO_TRAINER_CPU_PLAIN` does not name `onednn_linear` (paths.py). It sums in another order, so a run whose plan
recorded it and resumes where it is not offered samples differently, and the plan says so.
"""

from __future__ import annotations

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
    stamp = weight_stamp(self.weight)
    packed = self.__dict__.get(PACKED)
    if packed is None or packed[0] != stamp:
        rows = max(1, x.numel() // x.shape[-1])
        packed = self.__dict__[PACKED] = (stamp, mkldnn_reorder(self.weight, rows))
    return mkldnn_linear(x, packed[1], self.bias)


def drop_packed_weights(modules) -> None:
    for module in modules:
        module.__dict__.pop(PACKED, None)


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
