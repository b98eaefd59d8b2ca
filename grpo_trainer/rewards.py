"""Resolve, call and check reward functions.

A reward is a plain function with TRL's signature,
`fn(prompts, completions, completion_ids=None, **columns) -> list[float | None]`,
so a reward written for TRL works here unchanged. It is named in YAML as a
built-in (`math_accuracy`), `path/to/file.py:function` or
`package.module:function`, with `kwargs` passed on every call; an entry with
`model: PATH` is a learned reward model instead (reward_model.py). A function that
takes no `**kwargs` is given only the arguments it names. `async def` rewards
run concurrently. Built-ins may also accept `log_metric(name, value)` to report
counters, logged as `rewards/<name>/<metric>`.

Everything a reward can get wrong (import, signature, exception, wrong length,
non-numbers) stops the run with a RewardError naming the reward and the sample.
A reward with a `timeout` that does not return in time stops the run the same
way (naming the sample that hangs on its own), or with `on_timeout: none` its
batch is scored None and counted. Calls run under the trainer's deadline utility
(deadline.py): a reward with a `timeout` runs in a daemon thread, and a call past
it is abandoned there (it cannot be killed: it is Python in this process), never
holding the run or its exit; more than MAX_ABANDONED of one reward's calls still
running stops the run naming it. Async rewards run at once, each in its own
thread and event loop, so one that blocks instead of awaiting times out too.
Whatever a reward raises, SystemExit included, is its error.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import in_memory
from .config import RewardConfig
from .deadline import Call, Outcome, UserCalls, one_line, run_inline
from .errors import RewardError
from .user_functions import exec_registered, first_duplicate, resolve_function

# Built-in rewards: modules of the project's top-level `rewards/` folder. They are imported from that
# folder under a private package name (`builtin_module`), never as the top-level name `rewards`: a user's
# own `rewards.py` beside their config is first on sys.path and would stand in for it.
BUILTIN_REWARDS = {
    "math_accuracy": ("math_answer", "math_accuracy"),
    "think_format": ("format", "think_format"),
    "overlong_penalty": ("format", "overlong_penalty"),
    "code_tests": ("code_tests", "code_tests"),
}
BUILTIN_PACKAGE = "grpo_trainer._builtin_rewards"
BUILTIN_FOLDER = Path(__file__).resolve().parent.parent / "rewards"  # installed beside grpo_trainer/
# tool_calls: multi-turn only; environments, episodes: with `environment:` only
STANDARD_ARGS = ("prompts", "completions", "completion_ids", "tool_calls", "environments", "episodes")


@dataclass
class Reward:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None  # seconds per call on a batch (None: no limit)
    on_timeout: str = "error"  # or "none": the batch gets no opinion
    where: str = "rewards"  # its config path, for messages (rewards.N)
    # Where its calls run under the deadline (grpo_trainer/deadline.py); load_rewards gives one pool to all
    # the rewards of a run, so that async rewards run at once.
    calls: UserCalls = field(default_factory=lambda: reward_calls(), repr=False, compare=False)

    @property
    def label(self) -> str:
        """The reward, for the deadline's one-line stop: `reward 'slow_judge' (rewards.0)`."""
        return f"reward '{self.name}' ({self.where})"

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def arguments(self, available: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments this function can take, out of everything on offer."""
        params = inspect.signature(self.fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return available
        chosen = {k: v for k, v in available.items() if k in params}
        missing = [
            n
            for n, p in params.items()
            if n not in chosen
            and p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        if missing:
            offered = sorted(k for k in available if k != "log_metric")
            raise RewardError(
                f"reward '{self.name}': its parameter '{missing[0]}' is neither a dataset column nor a kwarg "
                f"(available: {', '.join(offered)})"
            )
        return chosen


def reward_calls() -> UserCalls:
    """A pool for reward calls under the deadline: a function with more than MAX_ABANDONED calls still running past
    its `timeout` stops the run (RewardError, one line naming it)."""
    return UserCalls("rewards", REWARD_WORKERS, MAX_ABANDONED, "rewards.N.timeout", stop=RewardError)


REWARD_WORKERS = 64  # reward calls at once: the async rewards of a batch, a hanging reward's per-sample probes
MAX_ABANDONED = 8  # one reward's timed-out calls still running (on_timeout: none) before the run stops


def load_rewards(configs: list[RewardConfig], policy_dtype: str = "float32", device: Any = None) -> list[Reward]:
    """The configured rewards, resolved and checked. Reward models (`model`) are loaded here, in the policy's
    dtype unless they set their own, on `device` (None: the trainer's); see reward_model.py."""
    rewards = []
    calls = reward_calls()
    for i, cfg in enumerate(configs):
        if cfg.model is not None:
            from .reward_model import load_reward_model

            fn: Callable[..., Any] = load_reward_model(
                cfg.model, where=f"rewards.{i}.model", policy_dtype=policy_dtype, device=device
            )
        else:
            fn = resolve_reward(cfg.name, where=f"rewards.{i}.name")
        own_name: str = cfg.name if cfg.name in BUILTIN_REWARDS or cfg.model else getattr(fn, "__name__", cfg.name)
        name = cfg.alias or own_name
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key in cfg.kwargs:
            if key in STANDARD_ARGS:
                raise RewardError(f"rewards.{i}.kwargs.{key}: '{key}' is passed by the trainer and cannot be set")
            if not takes_any and key not in params:
                raise RewardError(f"rewards.{i}.kwargs.{key}: reward '{name}' has no parameter '{key}'")
        rewards.append(
            Reward(
                name=name,
                fn=fn,
                weight=cfg.weight,
                kwargs=dict(cfg.kwargs),
                timeout=cfg.timeout,
                on_timeout=cfg.on_timeout,
                where=f"rewards.{i}",
                calls=calls,
            )
        )
    duplicate = first_duplicate([r.name for r in rewards])
    if duplicate:
        raise RewardError(f"rewards: two rewards are named '{duplicate}'; give one an `alias`")
    return rewards


def builtin_module(name: str):
    """A module of the built-in `rewards/` folder (e.g. `math_answer`), imported as grpo_trainer._builtin_rewards.NAME."""
    if BUILTIN_PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            BUILTIN_PACKAGE, BUILTIN_FOLDER / "__init__.py", submodule_search_locations=[str(BUILTIN_FOLDER)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"the built-in rewards folder {BUILTIN_FOLDER} cannot be imported")
        exec_registered(spec)
    return importlib.import_module(f"{BUILTIN_PACKAGE}.{name}")


def __getattr__(name: str):
    """`from grpo_trainer.rewards import math_accuracy`: the built-ins, by an import path no user file can shadow."""
    if name in BUILTIN_REWARDS:
        module, attr = BUILTIN_REWARDS[name]
        return getattr(builtin_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_reward(spec: str, where: str = "rewards") -> Callable[..., Any]:
    """`math_accuracy` | `path/to/file.py:fn` | `package.module:fn` | `object:reward/NAME` (a function given to
    grpo_trainer.train() in Python, see in_memory.py) -> the function."""
    if spec in BUILTIN_REWARDS:
        return __getattr__(spec)
    if in_memory.is_reference(spec):
        return in_memory.resolve(spec, where, RewardError)
    return resolve_function(spec, where, "reward", RewardError, builtins=list(BUILTIN_REWARDS))


@dataclass
class RewardBatch:
    """One batch's rewards: per function [N, R] (NaN = no opinion), their weighted sum [N], metrics."""

    per_function: torch.Tensor
    total: torch.Tensor
    metrics: dict[str, float]


def compute_rewards(
    rewards: list[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> RewardBatch:
    """Call every reward on the batch (async ones concurrently), check and combine the results.

    The total is the weighted sum of the rewards that had an opinion; NaN only
    when none had (then the sample is left out of its group's statistics).
    """
    n = len(completions)
    metrics: dict[str, float] = {}
    values: dict[str, list[float | None]] = {}

    def call(reward: Reward, rows: list[int] | None = None):
        """Call one reward on the batch, or on the given rows only (to find a failing sample)."""

        def log_metric(key: str, value: float) -> None:
            metrics[f"rewards/{reward.name}/{key}"] = metrics.get(f"rewards/{reward.name}/{key}", 0.0) + float(value)

        offered: dict[str, Any] = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
        }
        if rows is not None:
            offered = {k: [v[i] for i in rows] for k, v in offered.items()}
        offered.update(reward.kwargs)
        offered["log_metric"] = log_metric if rows is None else (lambda key, value: None)
        return reward.fn(**reward.arguments(offered))

    for reward in rewards:
        if reward.timeout is not None:
            metrics[f"rewards/{reward.name}/timed_out_batches"] = 0.0
    for reward in rewards:  # one at a time, in order
        if reward.is_async:
            continue
        outcome = _attempt(reward, functools.partial(call, reward))
        values[reward.name] = _check(reward, _result(reward, outcome, call, n, prompts, metrics), n, prompts)
        metrics[f"rewards/{reward.name}/seconds"] = outcome.seconds
    async_rewards = [r for r in rewards if r.is_async]
    for pool in {id(r.calls): r.calls for r in async_rewards}.values():  # all at once (one pool under load_rewards)
        batch = [r for r in async_rewards if r.calls is pool]
        outcomes = pool.run(
            [Call(functools.partial(_awaited, call, r), _limit(r), name=r.label) for r in batch], check=False
        )
        for reward, outcome in zip(batch, outcomes):
            values[reward.name] = _check(reward, _result(reward, outcome, call, n, prompts, metrics), n, prompts)
            metrics[f"rewards/{reward.name}/seconds"] = outcome.seconds
    for reward in rewards:
        reward.calls.check()  # too many of one reward's calls still running past its timeout: stop, naming it

    per_function = torch.tensor(
        [[math.nan if values[r.name][i] is None else values[r.name][i] for r in rewards] for i in range(n)],
        dtype=torch.float32,
    )  # [N, R]
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float32)
    has_opinion = ~torch.isnan(per_function)
    total = torch.where(has_opinion, per_function * weights, torch.zeros_like(per_function)).sum(1)
    total[~has_opinion.any(1)] = math.nan
    metrics.update(reward_statistics(rewards, per_function))
    return RewardBatch(per_function=per_function, total=total, metrics=metrics)


def unscored(rewards: list[Reward], per_function: torch.Tensor) -> list[str]:
    """The rewards that scored no completion of the batch (None or NaN for all of them; per_function: [N, R])."""
    return [reward.name for j, reward in enumerate(rewards) if not (~torch.isnan(per_function[:, j])).any()]


def reward_statistics(rewards: list[Reward], per_function: torch.Tensor) -> dict[str, float]:
    """`rewards/<name>/mean` and `.../std` over the samples each reward had an opinion on (per_function: [N, R])."""
    stats = {}
    for j, reward in enumerate(rewards):
        column = per_function[:, j]
        column = column[~torch.isnan(column)]
        stats[f"rewards/{reward.name}/mean"] = float(column.mean()) if column.numel() else math.nan
        stats[f"rewards/{reward.name}/std"] = float(column.std(unbiased=False)) if column.numel() else math.nan
    return stats


def _timed_out(reward: Reward, hung_sample: int | None, prompts: list[Any], metrics: dict[str, float]) -> list[None]:
    """A call over reward.timeout: the batch gets no opinion (counted), or the run stops naming the sample."""
    if reward.on_timeout == "none":
        metrics[f"rewards/{reward.name}/timed_out_batches"] = 1.0
        return [None] * len(prompts)
    where = (
        f"on sample {hung_sample} (prompt: {_short(prompts[hung_sample])})"
        if hung_sample is not None
        else (f"on a batch of {len(prompts)} completions (no single sample hung on its own)")
    )
    raise RewardError(
        f"reward '{reward.name}' did not return within {reward.timeout:g} s ({reward.where}.timeout) {where}; "
        f"raise the timeout, or set {reward.where}.on_timeout=none to score such batches None"
    )


def _awaited(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """An async reward's call, run to its end on an event loop of its own (in a thread of the deadline's pool)."""
    return asyncio.run(fn(*args, **kwargs))


def _limit(reward: Reward) -> float:
    return math.inf if reward.timeout is None else reward.timeout


def _attempt(reward: Reward, thunk: Callable[[], Any]) -> Outcome:
    """thunk() (a call of a sync reward) under the deadline: with a `timeout`, in a daemon thread of the reward's
    pool, abandoned when it overruns (it cannot be killed: it keeps running, but no longer holds up the run nor its
    exit); without one, in this thread. Either way whatever it raises, SystemExit included, is its outcome."""
    if reward.timeout is None:
        return run_inline(thunk)
    return reward.calls.run([Call(thunk, reward.timeout, name=reward.label)], check=False)[0]


def _result(
    reward: Reward, outcome: Outcome, call: Callable[..., Any], n: int, prompts: list[Any], metrics: dict[str, float]
) -> Any:
    """What a reward's call on the batch returned; a timeout scored None or stopping the run (naming the sample that
    hangs on its own), an error stopping the run naming the sample that raises it (sync rewards; async ones: the
    batch)."""
    if outcome.timed_out is not None:
        hung = None if reward.on_timeout == "none" else _hung(reward, call, n)
        return _timed_out(reward, hung, prompts, metrics)
    exc = outcome.exception
    if exc is None:
        return outcome.value
    if isinstance(exc, RewardError):
        raise exc
    if not reward.is_async:  # find the sample that breaks it, so the message can point at real data
        for i in range(min(len(prompts), 64)):
            single = _attempt(reward, functools.partial(call, reward, rows=[i])).exception
            if single is not None and not isinstance(single, RewardError):
                raise RewardError(
                    f"reward '{reward.name}' raised {one_line(single)} on sample {i} (prompt: {_short(prompts[i])})"
                ) from exc
    raise RewardError(f"reward '{reward.name}' raised {outcome.error}{_first_prompt(prompts)}") from exc


def _hung(reward: Reward, call: Callable[..., Any], n: int) -> int | None:
    """The first sample that, alone, does not return within the timeout (all probed at once, under the deadline)."""
    if reward.is_async:
        probes = [
            Call(functools.partial(_awaited, call, reward, rows=[i]), _limit(reward), name=reward.label)
            for i in range(n)
        ]
    else:
        probes = [Call(functools.partial(call, reward, rows=[i]), _limit(reward), name=reward.label) for i in range(n)]
    outcomes = reward.calls.run(probes, check=False)
    return next((i for i, outcome in enumerate(outcomes) if outcome.timed_out is not None), None)


def _first_prompt(prompts: list[Any]) -> str:
    return f" (on a batch of {len(prompts)} completions; first prompt: {_short(prompts[0])})" if prompts else ""


# The largest reward magnitude taken: rewards are held and summed in float32, where a larger finite Python float
# (1e300) is inf, and the step's advantages NaN (the step skipped, nothing said).
REWARD_LIMIT = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def _check(reward: Reward, out: Any, n: int, prompts: list[Any]) -> list[float | None]:
    values = _as_sequence(out)
    if values is None:
        raise RewardError(f"reward '{reward.name}' must return a list of {n} floats (or None), got {_kind(out)}")
    if len(values) != n:
        raise RewardError(
            f"reward '{reward.name}' returned {len(values)} values for {n} completions; it must return one per completion"
        )
    checked: list[float | None] = []
    for i, value in enumerate(values):
        number = reward_value(value)
        if number is _NOT_A_NUMBER:
            raise RewardError(
                f"reward '{reward.name}' returned {_shown(value)} for sample {i} (prompt: {_short(prompts[i])}); "
                "expected a float or None"
            )
        if number is not None and math.isinf(number):
            raise RewardError(f"reward '{reward.name}' returned {number} for sample {i} (prompt: {_short(prompts[i])})")
        if number is not None and abs(number) > REWARD_LIMIT:  # finite here, inf in float32
            raise RewardError(
                f"reward '{reward.name}' returned {number:g} for sample {i} (prompt: {_short(prompts[i])}), beyond "
                f"float32's range, in which rewards are summed: keep them within +-{REWARD_LIMIT:.3g}"
            )
        checked.append(None if number is None or math.isnan(number) else number)
    return checked


# What a reward may return, one rule for every array library (torch, NumPy, JAX: anything with `ndim`, `shape` and
# `item`): the batch's values as a list, a tuple or a 1-d array; each value None or a number: a Python int, float
# or bool (TRL reads True as 1.0), a NumPy scalar, a Decimal or Fraction (what has `__float__`), or a 0-d array or
# tensor of one. A string is not a number, whatever it spells ("1.0" as much as "yes"): a reward that returns text
# has a bug, and today's "1.0" is tomorrow's "1.0 (correct)".
class _Sentinel(enum.Enum):
    NOT_A_NUMBER = "not a number"


_NOT_A_NUMBER = _Sentinel.NOT_A_NUMBER


def _as_sequence(out: Any) -> list[Any] | None:
    """A reward's return value as a list of its values, or None when it is not a list, tuple or 1-d array."""
    if isinstance(out, (list, tuple)):
        return list(out)
    if _is_array(out) and out.ndim == 1:
        return list(out)  # its elements: 0-d arrays or NumPy scalars, each read by reward_value
    return None


def reward_value(value: Any) -> float | None | Literal[_Sentinel.NOT_A_NUMBER]:
    """One value a reward returned, as a float (NaN kept), None, or `_NOT_A_NUMBER`."""
    if _is_array(value):
        if value.ndim != 0:
            return _NOT_A_NUMBER
        value = value.item()
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):  # text, complex, a list, a dict
        return _NOT_A_NUMBER
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return _NOT_A_NUMBER


def _is_array(value: Any) -> bool:
    return hasattr(value, "ndim") and hasattr(value, "shape") and callable(getattr(value, "item", None))


def _kind(value: Any) -> str:
    return f"a {value.ndim}-d {type(value).__name__}" if _is_array(value) else type(value).__name__


def _shown(value: Any) -> str:
    if _is_array(value):
        return f"{_kind(value)} of shape {tuple(value.shape)}" if value.ndim else repr(value.item())
    return repr(value)


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
