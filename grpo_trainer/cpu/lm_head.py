"""The output head and per-token log-probs with less memory than autograd's paths, the same numbers bit for bit.

Two autograd functions that `models.TokenLogprobs` scores through (their docstrings say what each saves and
why), and the plain expressions they replace, which run where the fast path cannot:

* `TiedHead` (fast path `tied_head`): only where nothing wraps the head's calls, which is read from torch's
  module hook tables (torch_internals.call_hooks);
* `TargetLogprobs` (fast path `target_logprobs`): its backward calls ATen's log-softmax backward kernel directly
  (torch_internals.log_softmax_backward).

Where a torch detail they rely on has changed, or `GRPO_TRAINER_CPU_PLAIN` names them, autograd's path runs
(paths.py warns once; the run records it): the same numbers on the CPU, more memory. tests/test_rollout.py
holds both to autograd bit for bit; tests/test_cpu_layer.py holds the plain path to the fast one. (On a GPU the
blocks of rows a backward kernel is given may change its last bits; the entropy is reduced the same way on
both paths.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import paths
from .torch_internals import call_hooks, log_softmax_backward


def tied_head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)` for an output head whose weight the caller knows is the input embeddings' (and that no
    autocast or weight sharding wraps): through `TiedHead` where the head is a plain bias-free `nn.Linear` that
    nothing else wraps, and the fast path is usable."""
    if called_as_it_is(head) and head.bias is None and head.weight.requires_grad and paths.usable("tied_head"):
        return TiedHead.apply(hidden, head.weight)
    return head(hidden)


def called_as_it_is(module: nn.Module) -> bool:
    """A plain `nn.Linear` that nothing wraps: no hooks of its own or global ones (ZeRO-3's weight gathers, full
    backward hooks, ...), no `forward` replaced on the instance (accelerate's offloading hooks)."""
    return type(module) is nn.Linear and "forward" not in vars(module) and not any(call_hooks(module))


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[target] for [B, c, V] logits, and without a gradient the entropy: by
    `TargetLogprobs` where the fast path is usable, else by the plain autograd expression (the same numbers)."""
    if paths.usable("target_logprobs"):
        return TargetLogprobs.apply(logits, targets, temperature, with_entropy)
    logp_all = (logits / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():  # reduced as the fast path reduces it: the same bits on a GPU too
        return logp, TargetLogprobs._entropy(logp_all)


class TiedHead(torch.autograd.Function):
    """`F.linear(hidden, weight)` for an output head whose weight is also the input embeddings (tied), with the
    gradients autograd computes, bit for bit, but the weight's as a tensor of its own.

    The tied weight gets one gradient from the head and one from each embedding lookup (two in the shared-prompt
    layout: prompts, then completions), and autograd sums them before accumulating. Left to autograd, the
    head's contribution is a transposed view of its matmul's result (mm's backward for `W.t()`, then `t()`), which
    the engine will not add into in place: the first sum is a third vocabulary-sized tensor beside the two it
    adds (108 MiB each for SmolLM2, at the end of every backward, the peak of a training step there:
    docs/performance.md). Here the weight's gradient is the same product, `grad^T @ hidden` by the same kernel,
    returned as a plain contiguous tensor, so the lookups' gradients are added into it in place, in the same order.
    """

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return nn.functional.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        # As autograd's mm backward computes them for `hidden.reshape(-1, H) @ weight.t()`.
        rows = grad.reshape(-1, grad.shape[-1])
        grad_hidden = rows.mm(weight).view(hidden.shape) if ctx.needs_input_grad[0] else None
        grad_weight = rows.t().mm(hidden.reshape(-1, hidden.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


class TargetLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] for [B, c, V] logits (and, without a gradient, the entropy), with a backward
    that needs no vocabulary-sized memory beyond what the forward saved.

    Left to autograd, the backward of `(logits / T).log_softmax(-1).gather(-1, targets)` holds the saved log-softmax
    and allocates a one-hot gradient (made by a scatter into zeros), the log-softmax's gradient and the division's
    beside it, each [B, c, V] float32: for SmolLM2's 49152-token vocabulary and a 16 x 64 micro-batch, 192 MiB
    each at the start of every backward pass, which sets a pass's peak where the logits are large (long
    completions, large vocabularies; not the SmolLM2 bench's, docs/performance.md). Here the gradient is written
    over the saved log-softmax, a block of rows at a time, by the same ATen kernel autograd calls
    (`_log_softmax_backward_data`: torch_internals.log_softmax_backward), then divided by T in place: bit for bit
    the gradients autograd computes (tests/test_rollout.py), with no [B, c, V] tensor beyond the saved one. The saved tensor is consumed, so the
    backward can run once (no `retain_graph`).
    The forward skips dividing by T = 1 (exact) and reduces the entropy a block of rows at a time, so beside the
    logits it allocates the log-softmax (and logits / T where T != 1, freed at once) where the expression
    allocated four [B, c, V] tensors with the entropy. The entropy term of the loss (an entropy with a gradient)
    keeps autograd's path (models.TokenLogprobs._score_chunk).
    """

    BLOCK_BYTES = 16 * 2**20  # one-hot rows built at a time in the backward

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        logp_all = (logits if temperature == 1 else logits / temperature).log_softmax(-1)  # x / 1 == x
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        entropy = TargetLogprobs._entropy(logp_all) if with_entropy else None
        ctx.save_for_backward(logp_all, targets)
        ctx.temperature, ctx.consumed = temperature, False
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable  # a gradient of this gradient raises instead of silently having none
    def backward(ctx, grad_logp, _grad_entropy):
        if ctx.consumed:
            raise RuntimeError(
                "TokenLogprobs: a second backward through the same log-probs (retain_graph) is not "
                "supported: the first one computed its gradient in the saved log-softmax's memory"
            )
        ctx.consumed = True
        logp_all, targets = ctx.saved_tensors
        index, grad = targets.reshape(-1, 1), grad_logp.reshape(-1, 1).to(logp_all.dtype)
        for rows, block in TargetLogprobs._row_blocks(logp_all):
            # scatter_add_ into zeros, as autograd's gather backward does: 0 + (-0.0) is +0.0, so even the sign of a
            # zero gradient (masked positions give -0.0) comes out as autograd's
            one_hot = torch.zeros_like(block).scatter_add_(-1, index[rows], grad[rows])
            block.copy_(log_softmax_backward(one_hot, block))
        return (logp_all if ctx.temperature == 1 else logp_all.div_(ctx.temperature)), None, None, None

    @staticmethod
    def _entropy(logp_all: torch.Tensor) -> torch.Tensor:
        """-sum p log p per position, a block of rows at a time, without the whole-tensor expression's two [B, c, V]
        temporaries: on CPU the same numbers (each row is reduced alone; tested). A GPU's reduction may split a row
        by how many rows it is given, so there the last bits can differ from the whole-tensor expression's."""
        entropy = logp_all.new_empty(logp_all.shape[:-1])
        flat = entropy.view(-1)
        for rows, block in TargetLogprobs._row_blocks(logp_all):
            flat[rows] = -(block.exp() * block).sum(-1)
        return entropy

    @staticmethod
    def _row_blocks(logp_all: torch.Tensor):
        """(slice of rows, those rows of `logp_all` as a [rows, V] view), BLOCK_BYTES of them at a time."""
        vocab = logp_all.shape[-1]
        flat = logp_all.view(-1, vocab)
        step = max(1, TargetLogprobs.BLOCK_BYTES // (logp_all.element_size() * vocab))
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            yield rows, flat[rows]
