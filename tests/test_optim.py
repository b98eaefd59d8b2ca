"""grpo_trainer.cpu.adamw.BlockwiseAdamW: torch's AdamW numbers bit for bit, without parameter-sized temporaries."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_trainer.cpu.adamw import BlockwiseAdamW, adamw_for


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(301, 57, dtype=dtype)),  # 17157 elements: many blocks, ragged ends
            torch.nn.Parameter(torch.randn(1001, dtype=dtype)),
            torch.nn.Parameter(torch.randn(40, 23, dtype=dtype).t()),  # not contiguous: updated whole
            torch.nn.Parameter(torch.randn(5, dtype=dtype))]  # no gradient in some steps


def _run(optimizer_class, dtype, steps: int, weight_decay: float, state=None):
    params = _params(dtype)
    optimizer = optimizer_class(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay)
    if state is not None:
        optimizer.load_state_dict(state)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (i == 3 and step % 2) else torch.randn(p.shape, generator=generator).to(dtype)
        if step == 1:
            params[0].grad[0, :7] = 0.0  # moments that start at zero for some elements
        optimizer.param_groups[0]["lr"] = 1e-2 / (step + 1)  # a schedule, as the trainer's scheduler sets it
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("block", [1000, 4096])  # 1000: blocks that end between the kernels' vector lanes
def test_the_blockwise_step_is_torchs_adamw_bit_for_bit(dtype, weight_decay, block, monkeypatch):
    monkeypatch.setattr(BlockwiseAdamW, "BLOCK_ELEMENTS", block)
    ours, ours_optimizer = _run(BlockwiseAdamW, dtype, 5, weight_decay)
    theirs, theirs_optimizer = _run(torch.optim.AdamW, dtype, 5, weight_decay)
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        mine, torchs = ours_optimizer.state[a], theirs_optimizer.state[b]
        assert same_bits(mine["exp_avg"], torchs["exp_avg"]) and same_bits(mine["exp_avg_sq"], torchs["exp_avg_sq"])
        assert torch.equal(mine["step"], torchs["step"]) and mine["step"].dtype == torchs["step"].dtype


@pytest.mark.parametrize("saved_by", [torch.optim.AdamW, BlockwiseAdamW])
def test_checkpoints_move_between_torchs_adamw_and_ours(saved_by):
    """The state is torch's: a run saved by either continues the same in both."""
    _, saver = _run(saved_by, torch.float32, 3, 0.1)
    state = saver.state_dict()  # loading shares its tensors, which the steps then update: one copy each
    continued, _ = _run(BlockwiseAdamW, torch.float32, 2, 0.1, state=copy.deepcopy(state))
    reference, _ = _run(torch.optim.AdamW, torch.float32, 2, 0.1, state=copy.deepcopy(state))
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(continued, reference))


def test_the_trainer_uses_it_on_the_cpu_only_and_not_under_deepspeed():
    from types import SimpleNamespace

    def accelerator(device: str, deepspeed=None):
        return SimpleNamespace(device=torch.device(device), state=SimpleNamespace(deepspeed_plugin=deepspeed))

    assert adamw_for(accelerator("cpu")) is BlockwiseAdamW
    assert adamw_for(accelerator("cuda")) is torch.optim.AdamW
    assert adamw_for(accelerator("cpu", deepspeed=object())) is torch.optim.AdamW  # it steps its flat partitions


def test_no_temporary_is_larger_than_a_block(monkeypatch):
    class LargestAllocation(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.numel())
            return out

    monkeypatch.setattr(BlockwiseAdamW, "BLOCK_ELEMENTS", 1024)
    sizes = {}
    for optimizer_class in (BlockwiseAdamW, torch.optim.AdamW):
        param = torch.nn.Parameter(torch.randn(64, 300))
        optimizer = optimizer_class([param], lr=1e-3)
        param.grad = torch.randn(64, 300)
        optimizer.step()  # the first step makes the moments (parameter-sized, kept): not temporaries
        param.grad = torch.randn(64, 300)
        with LargestAllocation() as mode:
            optimizer.step()
        sizes[optimizer_class] = mode.largest
    assert sizes[BlockwiseAdamW] <= 1024 < sizes[torch.optim.AdamW] == 64 * 300


@pytest.mark.parametrize("option", [{"amsgrad": True}, {"foreach": True}, {"maximize": True}, {"lr": torch.tensor(1e-3)}])
def test_options_it_does_not_reproduce_are_refused_when_it_is_made_and_when_a_state_brings_them(option):
    with pytest.raises(ValueError, match="use torch.optim.AdamW"):
        BlockwiseAdamW([torch.nn.Parameter(torch.randn(3))], **option)
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = BlockwiseAdamW([param])
    optimizer.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], **option).state_dict())
    param.grad = torch.randn(3)
    with pytest.raises(ValueError, match="use torch.optim.AdamW"):
        optimizer.step()


def test_a_parameter_off_the_cpu_is_refused_when_it_steps():
    param = torch.nn.Parameter(torch.randn(3, device="meta"))
    param.grad = torch.randn(3, device="meta")
    with pytest.raises(ValueError, match="on meta"):
        BlockwiseAdamW([param], lr=1e-3).step()
