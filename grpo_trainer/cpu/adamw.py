"""AdamW whose step on CPU makes no parameter-sized temporaries: torch's numbers, bit for bit.

torch's AdamW on CPU (the single-tensor implementation, its CPU default) computes each parameter's update
denominator as `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two temporaries the size of the
parameter. For a tied 49152 x 576 embedding that is 216 MiB of fresh memory at every optimizer step, on top of
the weights, gradients and both moments, and it set one of the two plateaus of SmolLM2's peak resident memory
(docs/performance.md, "Where the peak is"). `BlockwiseAdamW.step` computes the same expressions a block of
elements at a time (views: every operation is elementwise, so each element sees the same arithmetic), and the
in-place parts (weight decay, both moments) on whole tensors as torch does. tests/test_optim.py holds it to
`torch.optim.AdamW` bit for bit over several steps, so a torch upgrade that changes the formula fails there.

It covers what the trainer asks of AdamW on CPU (`adamw_for` picks torch's class on other devices, whose
default there is the foreach implementation, and under DeepSpeed, which steps its own flat partitions): real
CPU parameters, float hyperparameters, none of the amsgrad, maximize, capturable, differentiable, foreach or
fused options; anything else is refused when it is made and when it steps (a loaded state dict brings its own
options). The state is torch's (torch's private `_init_group` makes it: torch_internals.adamw_init_group), so
checkpoints load in either class, and its arithmetic is that of torch's private `_single_tensor_adam`
(torch_internals.adamw_step). Where either is not as expected, or `GRPO_TRAINER_CPU_PLAIN` names `adamw`,
torch's class is built instead (paths.py warns once; the run records it).
"""

from __future__ import annotations

import torch

from . import paths
from .torch_internals import adamw_init_group, adamw_step


def adamw_for(accelerator) -> type[torch.optim.AdamW]:
    """The AdamW class the trainer builds: BlockwiseAdamW where the policy trains on the CPU without DeepSpeed and
    the fast path is usable here, torch's own elsewhere."""
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
    if accelerator.device.type == "cpu" and not deepspeed and paths.usable("adamw"):
        return BlockwiseAdamW
    return torch.optim.AdamW


class BlockwiseAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW`, with a CPU step whose temporaries are BLOCK_ELEMENTS elements, not a parameter's."""

    # Elementwise operations give each element the same bits however a tensor is split (torch's own threads split
    # it anywhere); the block only bounds the temporaries: 4 MiB of float32.
    BLOCK_ELEMENTS = 2**20

    OPTIONS_NOT_COVERED = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._refuse_what_it_does_not_reproduce()

    def _refuse_what_it_does_not_reproduce(self) -> None:
        for group in self.param_groups:
            options = [option for option in self.OPTIONS_NOT_COVERED if group.get(option)]
            if (
                options
                or any(isinstance(group[key], torch.Tensor) for key in ("lr", "eps", "weight_decay"))
                or any(isinstance(beta, torch.Tensor) for beta in group["betas"])
            ):
                raise ValueError(
                    f"BlockwiseAdamW reproduces torch's plain single-tensor AdamW step only; "
                    f"got {', '.join(options) or 'a tensor hyperparameter'}: use torch.optim.AdamW"
                )

    @torch.no_grad()
    def step(self, closure=None):
        self._refuse_what_it_does_not_reproduce()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = adamw_init_group(self, group)
            for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                if param.device.type != "cpu" or torch.is_complex(param):
                    raise ValueError(
                        f"BlockwiseAdamW steps real CPU parameters only; got a {param.dtype} parameter "
                        f"on {param.device}: use torch.optim.AdamW there"
                    )
                adamw_step(param, grad, exp_avg, exp_avg_sq, step, group, self._blocks)
        return loss

    def _blocks(self, *tensors: torch.Tensor):
        """The same BLOCK_ELEMENTS-element slice of each (flat views); all of each if one is not contiguous."""
        if not all(t.is_contiguous() for t in tensors):
            yield tensors
            return
        flats = [t.view(-1) for t in tensors]
        for start in range(0, flats[0].numel(), self.BLOCK_ELEMENTS):
            yield tuple(flat[start : start + self.BLOCK_ELEMENTS] for flat in flats)
