"""Every torch detail the CPU layer relies on that is not torch's public API, each with a check.

The fast paths of this package reproduce torch's numbers by leaning on how torch does things inside: the byte
layout of the CPU generator's state, the stream `exponential_` draws from it, AdamW's `_init_group` and the
arithmetic of its single-tensor step, the module hook tables, an ATen backward kernel, oneDNN's linear ops.
A torch release may change any of them without notice. So each reliance is read here only, and has a `check_*()` that returns None where the detail
is as this code expects, or one line naming the torch detail that changed:

* `paths.usable` runs a fast path's checks once per process, before the path is first used; where one fails,
  the plain path runs instead (warned once, recorded in the run);
* tests/test_cpu_layer.py runs every check, so a torch upgrade that changes a detail fails there with that line.

What is deliberately not checked here: that a fast path's numbers equal torch's on real shapes and dtypes (each
path's tests do that: tests/test_decode_kernels.py, tests/test_optim.py, tests/test_rollout.py); the checks are
small enough to run at the start of every run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

# ----------------------------------------------------------------------------- the CPU generator's state

MT_WORDS = 624  # mt19937 state size, in 32-bit words
# torch's CPU generator state (CPUGeneratorImplState, the "legacy" layout torch.get_rng_state() returns):
# uint64 seed | int32 left | int32 seeded | uint64 next | uint64 state[624] | normal-sample cache...
_LEFT, _NEXT, _KEY = 8, 16, 24
STATE_BYTES = 5056
GENERATOR_STATE = "torch.get_rng_state()'s layout (CPUGeneratorImplState: seed, left, seeded, next, state[624], ...)"


def twister_state() -> tuple[np.ndarray, int, torch.Tensor]:
    """The default CPU generator as (key uint32[624], pos, raw state): pos is the index of the next word,
    624 meaning "twist first" (numpy's MT19937 convention). torch keeps a countdown `left` instead:
    it twists when `left` reaches 1, and otherwise `next` is the index."""
    raw = torch.get_rng_state()
    view = raw.numpy()
    left = int(view[_LEFT : _LEFT + 4].view(np.int32)[0])
    nxt = int(view[_NEXT : _NEXT + 8].view(np.uint64)[0])
    key = view[_KEY : _KEY + 8 * MT_WORDS].view(np.uint64).astype(np.uint32)
    return key, MT_WORDS if left == 1 else nxt, raw


def set_twister_state(key: np.ndarray, pos: int, raw: torch.Tensor) -> None:
    """Write an advanced (key, pos) back into the default generator, everything else of `raw` unchanged."""
    view = raw.numpy()
    view[_LEFT : _LEFT + 4].view(np.int32)[0] = 1 if pos >= MT_WORDS else MT_WORDS + 1 - pos
    view[_NEXT : _NEXT + 8].view(np.uint64)[0] = pos
    view[_KEY : _KEY + 8 * MT_WORDS].view(np.uint64)[:] = key
    torch.set_rng_state(raw)


def check_generator_state() -> str | None:
    """The layout above, and the stream the draws emulate: `exponential_` on a float32 CPU tensor takes two
    32-bit mt19937 outputs, keeps their low 53 bits as u in [0, 1) and returns (float)(-log1p(-u))."""
    if len(torch.get_rng_state()) != STATE_BYTES:
        return f"{GENERATOR_STATE}: {len(torch.get_rng_state())} bytes, expected {STATE_BYTES}"
    seed = 1234
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        key, pos, raw = twister_state()
        # mt19937's own seeding (init_genrand), which numpy's legacy RandomState shares
        legacy_state: Any = np.random.RandomState(seed).get_state()  # ("MT19937", key, pos, ...)
        if pos != MT_WORDS or not np.array_equal(key, legacy_state[1]):
            return f"{GENERATOR_STATE}: after manual_seed({seed}) the words are not at byte {_KEY} or `left` not at byte {_LEFT}"
        value = float(torch.empty(1).exponential_()[0])
        twister = np.random.MT19937()
        twister.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
        high, low = (int(word) for word in twister.random_raw(2))
        key_after, pos_after, raw = twister_state()
        if pos_after != 2 or not np.array_equal(key_after, twister.state["state"]["key"]):
            return f"{GENERATOR_STATE}: after one draw `next` (byte {_NEXT}) is {pos_after}, expected 2"
        u = ((high << 32 | low) & (2**53 - 1)) * 2.0**-53
        if value != float(np.float32(-math.log1p(-u))):
            return (
                "torch's CPU exponential_ no longer returns (float)(-log1p(-u)) for u the low 53 bits of two "
                "mt19937 outputs"
            )
        set_twister_state(key, pos, raw)  # written back: the same first draw again
        if float(torch.empty(1).exponential_()[0]) != value:
            return f"{GENERATOR_STATE}: writing `left`/`next`/state back with torch.set_rng_state does not restore it"
    return None


# ----------------------------------------------------------------------------- AdamW's _init_group

INIT_GROUP = "torch.optim.AdamW._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)"


def adamw_init_group(optimizer: torch.optim.AdamW, group: dict) -> tuple[list, list, list, list, list]:
    """torch's own state for one parameter group, made where missing: (params, grads, exp_avgs, exp_avg_sqs,
    state_steps) of the parameters that have a gradient."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    return params, grads, exp_avgs, exp_avg_sqs, steps


def check_adamw_init_group() -> str | None:
    """`_init_group` takes the lists positionally in that order, fills them for a parameter with a gradient,
    and makes the state `step` (a tensor), `exp_avg` and `exp_avg_sq` (zeros like the parameter)."""
    init_group = getattr(torch.optim.AdamW, "_init_group", None)
    if init_group is None:
        return f"{INIT_GROUP}: torch.optim.AdamW has no _init_group"
    parameters = list(inspect.signature(init_group).parameters)
    if len(parameters) != 8:
        return f"{INIT_GROUP}: it takes {parameters[1:]}"
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    optimizer = torch.optim.AdamW([param])
    try:
        params, grads, exp_avgs, exp_avg_sqs, steps = adamw_init_group(optimizer, optimizer.param_groups[0])
    except Exception as exc:  # noqa: BLE001 (any failure is the change this check reports)
        return f"{INIT_GROUP}: calling it failed ({type(exc).__name__}: {exc})"
    state = optimizer.state[param]
    if not (
        len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == 1
        and params[0] is param
        and grads[0] is param.grad
        and exp_avgs[0] is state.get("exp_avg")
        and exp_avg_sqs[0] is state.get("exp_avg_sq")
        and steps[0] is state.get("step")
    ):
        return (
            f"{INIT_GROUP}: the lists it fills are not (params, grads, exp_avgs, exp_avg_sqs, state_steps) of the state"
        )
    if not (
        isinstance(steps[0], torch.Tensor)
        and steps[0].numel() == 1
        and float(steps[0]) == 0
        and torch.equal(exp_avgs[0], torch.zeros(3))
        and torch.equal(exp_avg_sqs[0], torch.zeros(3))
    ):
        return f"{INIT_GROUP}: the state it makes is not step=tensor(0.), exp_avg=zeros, exp_avg_sq=zeros"
    return None


ADAM_STEP = "torch.optim.adam._single_tensor_adam's arithmetic (torch.optim.AdamW's step on CPU)"


def adamw_step(param, grad, exp_avg, exp_avg_sq, step_t, group: dict, blocks: Callable) -> None:
    """torch.optim.adam._single_tensor_adam for one parameter (decoupled weight decay), with the denominator and the
    parameter update made over `blocks(param, exp_avg, exp_avg_sq)`: matching views of the three (elementwise
    operations give each element the same bits however a tensor is split)."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    step_t += 1
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    for param_block, avg_block, sq_block in blocks(param, exp_avg, exp_avg_sq):
        denom = (sq_block.sqrt() / bias_correction2_sqrt).add_(eps)
        param_block.addcdiv_(avg_block, denom, value=-step_size)


def check_adamw_step() -> str | None:
    """Three steps of torch.optim.AdamW on CPU (its default there: the single-tensor implementation) and of
    `adamw_step` on the same state give the same parameters bit for bit."""
    theirs = nn.Parameter(torch.linspace(-1, 1, 7))
    ours = nn.Parameter(theirs.detach().clone())
    options = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    optimizers = torch.optim.AdamW([theirs], **options), torch.optim.AdamW([ours], **options)
    for k in range(1, 4):
        theirs.grad, ours.grad = torch.linspace(-k, 2.0, 7), torch.linspace(-k, 2.0, 7)
        optimizers[0].step()
        group = optimizers[1].param_groups[0]
        params, grads, exp_avgs, exp_avg_sqs, steps = adamw_init_group(optimizers[1], group)
        with torch.no_grad():
            adamw_step(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], steps[0], group, lambda *tensors: [tensors])
    return None if torch.equal(theirs, ours) else f"{ADAM_STEP}: no longer the arithmetic adamw_step reproduces"


# ----------------------------------------------------------------------------- the module hook tables

HOOK_TABLES = "torch.nn.modules.module's hook tables"
# Every table whose hooks run when a module is called, global and per module; the "marks" only qualify entries
# of those (keyed `_with_kwargs` / `_always_called` tables, the full-backward flag).
GLOBAL_CALL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
GLOBAL_MARKS = (
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_is_full_backward_hook",
)
MODULE_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
MODULE_MARKS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def call_hooks(module: nn.Module) -> tuple[dict, ...]:
    """The hook tables whose hooks would run around a call of `module`: its own and the global ones."""
    from torch.nn.modules import module as module_globals

    return tuple(getattr(module, name) for name in MODULE_CALL_HOOKS) + tuple(
        getattr(module_globals, name) for name in GLOBAL_CALL_HOOKS
    )


def check_module_hook_tables() -> str | None:
    """The tables above exist as dicts, registering a hook (global or the module's) puts it in one, and torch has
    no other table of hooks run around a module call (one added later would go unseen)."""
    from torch.nn.modules import module as module_globals

    known_global = set(GLOBAL_CALL_HOOKS + GLOBAL_MARKS)
    found_global = {
        name
        for name in vars(module_globals)
        if name.startswith("_global_") and ("forward" in name or "backward" in name)
    }
    if found_global != known_global:
        return f"{HOOK_TABLES}: global call-hook tables are {sorted(found_global)}, expected {sorted(known_global)}"
    probe = nn.Linear(1, 1)
    found_module = {
        name
        for name in vars(probe)
        if name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called"))
        and ("forward" in name or "backward" in name)
    }
    if found_module != set(MODULE_CALL_HOOKS + MODULE_MARKS):
        return (
            f"{HOOK_TABLES}: a module's call-hook tables are {sorted(found_module)}, "
            f"expected {sorted(MODULE_CALL_HOOKS + MODULE_MARKS)}"
        )
    if not all(isinstance(table, dict) and not table for table in call_hooks(probe)[: len(MODULE_CALL_HOOKS)]):
        return f"{HOOK_TABLES}: a new module's {MODULE_CALL_HOOKS} are not empty dicts"
    registrations = [
        (lambda: probe.register_forward_hook(lambda *a: None), "_forward_hooks"),
        (lambda: probe.register_forward_pre_hook(lambda *a: None), "_forward_pre_hooks"),
        (lambda: probe.register_full_backward_hook(lambda *a: None), "_backward_hooks"),
        (lambda: probe.register_full_backward_pre_hook(lambda *a: None), "_backward_pre_hooks"),
        (lambda: nn.modules.module.register_module_forward_hook(lambda *a: None), "_global_forward_hooks"),
        (lambda: nn.modules.module.register_module_forward_pre_hook(lambda *a: None), "_global_forward_pre_hooks"),
        (lambda: nn.modules.module.register_module_full_backward_hook(lambda *a: None), "_global_backward_hooks"),
        (
            lambda: nn.modules.module.register_module_full_backward_pre_hook(lambda *a: None),
            "_global_backward_pre_hooks",
        ),
    ]
    for register, table in registrations:
        handle = register()
        try:
            owner = module_globals if table.startswith("_global_") else probe
            if not getattr(owner, table):
                return f"{HOOK_TABLES}: a registered hook is not in {table}"
        finally:
            handle.remove()
    return None


# ----------------------------------------------------------------------------- ATen's log-softmax backward

LOG_SOFTMAX_BACKWARD = "torch._log_softmax_backward_data(grad_output, output, dim, input_dtype)"


def log_softmax_backward(grad: torch.Tensor, log_softmax: torch.Tensor) -> torch.Tensor:
    """The gradient of log_softmax(x, -1) at output `log_softmax`, by the ATen kernel autograd calls."""
    return torch._log_softmax_backward_data(grad, log_softmax, -1, log_softmax.dtype)


def check_log_softmax_backward_data() -> str | None:
    """It exists, takes those arguments and gives autograd's gradient of log_softmax bit for bit."""
    if not hasattr(torch, "_log_softmax_backward_data"):
        return f"{LOG_SOFTMAX_BACKWARD}: torch has no _log_softmax_backward_data"
    x = torch.linspace(-3, 2, 12).reshape(3, 4).requires_grad_()
    grad = torch.linspace(1, -1, 12).reshape(3, 4)
    out = x.log_softmax(-1)
    (expected,) = torch.autograd.grad(out, x, grad)
    try:
        got = log_softmax_backward(grad, out.detach())
    except Exception as exc:  # noqa: BLE001 (any failure is the change this check reports)
        return f"{LOG_SOFTMAX_BACKWARD}: calling it failed ({type(exc).__name__}: {exc})"
    return (
        None if torch.equal(got, expected) else f"{LOG_SOFTMAX_BACKWARD}: no longer autograd's gradient of log_softmax"
    )


# ----------------------------------------------------------------------------- oneDNN's packed linear

MKLDNN_LINEAR = "torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise and Tensor._version"


def mkldnn_reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` reordered into oneDNN's blocked layout for about `rows` rows (as inductor's freezing does)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def mkldnn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when a weight's values may have: its storage and its in-place version counter."""
    return weight.data_ptr(), weight._version


def check_mkldnn_linear() -> str | None:
    """oneDNN is built in, both ops exist and compute F.linear (up to summation order), and an in-place change
    moves a tensor's `_version`."""
    if not torch.backends.mkldnn.is_available():
        return f"{MKLDNN_LINEAR}: this torch has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    for op in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, op):
            return f"{MKLDNN_LINEAR}: torch.ops.mkldnn has no {op}"
    weight = torch.linspace(-1, 1, 24).reshape(6, 4)
    x, bias = torch.linspace(0, 1, 8).reshape(2, 4), torch.linspace(0, 1, 6)
    try:
        got = mkldnn_linear(x, mkldnn_reorder(weight, 2), bias)
    except Exception as exc:  # noqa: BLE001 (any failure is the change this check reports)
        return f"{MKLDNN_LINEAR}: calling them failed ({type(exc).__name__}: {exc})"
    if not torch.allclose(got, nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-6):
        return f"{MKLDNN_LINEAR}: their result is not F.linear's"
    before = weight_stamp(weight)
    weight.add_(1)
    return None if weight_stamp(weight) != before else f"{MKLDNN_LINEAR}: an in-place add does not move Tensor._version"


CHECKS: dict[str, Callable[[], str | None]] = {
    "generator_state": check_generator_state,
    "adamw_init_group": check_adamw_init_group,
    "adamw_step": check_adamw_step,
    "module_hook_tables": check_module_hook_tables,
    "log_softmax_backward_data": check_log_softmax_backward_data,
    "mkldnn_linear": check_mkldnn_linear,
}
