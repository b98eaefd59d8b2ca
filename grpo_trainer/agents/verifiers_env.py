"""`environment.verifiers`: a verifiers 0.4 (v1) environment, played against the run's token endpoint.

`environment.verifiers: my_env` names an importable module, or `path/to/file.py`, that exports one `Taskset`
subclass (and optionally an `Env` and a `Harness`), as verifiers' own loader asks. `VerifiersPlayer` is a player
of the agent producer (`play(row, episode, seed) -> Played`): each call is one verifiers episode
(`env.run_slot`) of the row's task, the G calls of a prompt are its group, and every model call of the episode
goes, through verifiers' interception server and its train client, to the episode's token endpoint
(`POST /inference/v1/generate`), rendered by a local renderer built from the policy's own tokenizer (saved to a
folder: `renderer_model_name`). The episode's key rides in the train client's `Authorization` header, so each
episode samples only into its own record and budget (never in an environment variable, which a subprocess
harness of another episode would inherit); it is removed from the traces' client configs once the episode ends,
and is dead then anyway (the endpoint answers a closed episode 410).

What becomes of an episode (`played`):
- each trainable branch of each trainable trace (`trace.branches`: one per root-to-leaf path) is one sample: the
  tokens before its first sampled token are the prompt, the rest the completion, the loss mask its
  `sampled_mask`, the sampler log-probs its `logprobs` (0 where not sampled);
- `trace.reward` (verifiers' weighted sum) is the `environment` reward; each of `trace.rewards` and
  `trace.metrics` is logged as `verifiers/reward/<name>`, `verifiers/metric/<name>`;
- an episode that is not ok (`episode.ok`, `trace.ok`: verifiers never raises for them) is `Played(ok=False,
  error=...)`, which the producer scores by `environment.on_error`;
- counters: `verifiers/errors`, `verifiers/branches`, `verifiers/turns`, `verifiers/tokens` (completion tokens
  sampled); the last trainable trace's `stop_condition` is the episode's, counted by the engine per name
  (`environment/agent/stop/<name>`, the names verifiers can stop with declared in `stop_conditions`).

Offline only: every agent role runs in the `subprocess` runtime (a role left at verifiers' default, the remote
`prime` sandbox, is moved to it; any other runtime is refused), and a harness of verifiers' own
(`verifiers.v1.harnesses.*`: `null` and `bash` `uv sync` a PEP-723 script at run time, the rest install agent
programs) is refused in one line: use an in-process harness (grpo_trainer/agents/vf_harness.py) or your own.

Rows: the taskset's tasks are the prompts (`task.data` as the row: `prompt`, and the task's own fields) unless
`data:` is given explicitly (`data.source` set in the config, not left at its default `builtin:arithmetic`), in
which case each row must validate as the taskset's task data (`prompt` plus its fields).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import math
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from ..deadline import call_alone
from ..errors import ConfigError
from .producer import EpisodeHandle, Played, PlayerEnvironment
from .records import Branch

MODULE_PREFIX = "grpo_trainer_vf_"  # the name an environment module is registered under (verifiers' plugin ids)


class VerifiersEnvError(ConfigError):
    """An environment that cannot be loaded or trained here: said in one line, naming environment.verifiers."""


def import_environment(spec: str) -> tuple[ModuleType, str]:
    """The module `spec` names (an importable module or a `.py` file), registered in `sys.modules` under a plain
    name verifiers' loader can import (it takes plugin ids without dots)."""
    path = Path(spec)
    if spec.endswith(".py"):
        if not path.is_file():
            raise VerifiersEnvError(f"environment.verifiers: no file {spec!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path.resolve())
        if module_spec is None or module_spec.loader is None:
            raise VerifiersEnvError(f"environment.verifiers: cannot import {spec!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            raise VerifiersEnvError(f"environment.verifiers {spec!r}: cannot import it: {exc}") from None
    alias = MODULE_PREFIX + re.sub(r"[^a-z0-9_]", "_", spec.lower())
    alias = f"{alias}_{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
    sys.modules[alias] = module
    return module, alias


def load_environment(spec: str, *, max_turns: int | None = None, limit: float = math.inf):
    """The verifiers `Env` of `spec`, every role on the subprocess runtime; refuses what would download.

    Importing the module and building its Env run user code: they run under the deadline utility, within `limit`
    (environment.step_timeout), so a module that hangs or exits stops the run in one line instead of hanging it."""
    outcome = call_alone(
        lambda: _load_environment(spec, max_turns),
        limit,
        name=f"environment.verifiers {spec}",
        limit_key="environment.step_timeout",
        stop=VerifiersEnvError,
        label="loading",
    )
    if outcome.timed_out is not None:
        raise VerifiersEnvError(
            f"environment.verifiers {spec!r}: loading it took longer than {limit:g}s (environment.step_timeout)"
        )
    if not outcome.ok:
        raise VerifiersEnvError(f"environment.verifiers {spec!r}: loading it raised {outcome.error}")
    return outcome.value


def _load_environment(spec: str, max_turns: int | None):
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class, harness_class

    _, alias = import_environment(spec)
    try:
        env_cls = environment_class(alias)
        config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
        config = config_cls.model_validate({"taskset": {"id": alias}})
    except (TypeError, ValueError, AttributeError, ImportError) as exc:  # verifiers' loader: no/several Tasksets, ...
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VerifiersEnvError(f"environment.verifiers {spec!r}: {line}") from None
    for role, agent in agent_config_fields(config).items():
        runtime = getattr(agent.runtime, "type", None)
        if runtime == "prime":
            agent.runtime = vf.SubprocessConfig()
        elif runtime != "subprocess":
            raise VerifiersEnvError(
                f"environment.verifiers {spec!r}: role {role!r} runs in the {runtime!r} runtime; only the local "
                "'subprocess' runtime is supported here (nothing is fetched or run remotely)"
            )
    for role, harness in config.agent_harnesses().items():
        cls = harness_class(harness.id)
        if cls.__module__.startswith("verifiers.v1.harnesses."):
            raise VerifiersEnvError(
                f"environment.verifiers {spec!r}: role {role!r} uses verifiers' harness {harness.id!r}, which "
                "downloads its program at run time (uv sync of a PEP-723 script, or an installed agent): export an "
                "in-process harness from the environment module (grpo_trainer.agents.vf_harness.InProcessChatHarness)"
            )
    if max_turns is not None:
        for agent in agent_config_fields(config).values():
            if agent.max_turns is None:
                agent.max_turns = max_turns
    return vf.load_environment(config)


def taskset_rows(env, limit: int | None = None) -> list[dict[str, Any]]:
    """The taskset's tasks as dataset rows (`task.data` without verifiers' bookkeeping)."""
    rows = []
    for task in env.taskset if limit is None else env.taskset.take(limit):
        rows.append(task.data.model_dump(mode="json", exclude_defaults=True, exclude={"idx"}))
    return rows


def branch_sample(token_ids: list[int], sampled_mask: list[bool], logprobs: list[float], turns: int) -> Branch | None:
    """One trace branch as a training sample: the prompt is what comes before the first sampled token."""
    if True not in sampled_mask:
        return None
    cut = sampled_mask.index(True)
    return Branch(
        prompt_ids=list(token_ids[:cut]),
        completion_ids=list(token_ids[cut:]),
        completion_mask=[int(m) for m in sampled_mask[cut:]],
        logprobs=[float(x) if m else 0.0 for x, m in zip(logprobs[cut:], sampled_mask[cut:])],
        turns=list(range(turns)),
    )


COUNTERS = ("errors", "turns", "tokens", "branches")
# verifiers 0.4's stop conditions (trace.stop_condition): what its agents and harnesses stop a trace with, the
# framework limits, `<stage>_timeout` for its stage deadlines (rollout.py) and `<boundary>_error` for its typed
# errors (errors.py, `stop_condition`); any other counts as `other` (engine.py, stop_names).
STOP_CONDITIONS = (
    "user_closed", "agent_completed", "empty_action", "max_turns", "max_input_tokens", "max_output_tokens",
    "max_total_tokens", "compaction_failed", "error",
    *(f"{stage}_timeout" for stage in ("setup", "agent", "finalize", "scoring")),
)  # fmt: skip


def stop_conditions() -> tuple[str, ...]:
    """STOP_CONDITIONS and one `<boundary>_error` per typed error of the installed verifiers."""
    from verifiers.v1.errors import RolloutError, stop_condition

    errors, todo = [], list(RolloutError.__subclasses__())
    while todo:
        cls = todo.pop(0)
        errors.append(stop_condition(cls.__new__(cls)))
        todo += cls.__subclasses__()
    return tuple(dict.fromkeys([*STOP_CONDITIONS, *sorted(errors)]))


class VerifiersPlayer:
    """Plays a verifiers environment's episodes against the token endpoint (the agent producer's `Player`)."""

    def __init__(
        self,
        spec: str,
        tokenizer,
        *,
        model_name: str = "policy",
        max_tokens: int | None = None,
        max_turns: int | None = None,
        renderer: Any = None,
        load_limit: float = math.inf,
    ):
        self.spec = spec
        self.name = f"environment.verifiers {spec}"
        self.env = load_environment(spec, max_turns=max_turns, limit=load_limit)
        self.model_name = model_name
        self.max_tokens = max_tokens
        self.renderer = renderer  # a renderers.RendererConfig; None: the default renderer (the chat template)
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="grpo-vf-tokenizer-")
        tokenizer.save_pretrained(self._tokenizer_dir.name)
        task_cls = type(self.env.taskset).task_type()
        self._task_cls = task_cls
        self._data_cls = task_cls.data_type()
        probe = task_cls(self._data_cls.model_construct(), self.env.taskset.config.task)
        signals = [f"reward/{fn.__name__}" for fn in probe.hooks("reward")]
        signals += [f"metric/{fn.__name__}" for fn in probe.hooks("metric")]
        # Declared for the engine (summed over the batch, logged as environment/agent/<name>, and the last
        # trainable trace's stop condition as environment/agent/stop/<name>).
        self.counter_names = tuple(f"verifiers/{n}" for n in (*COUNTERS, *signals))
        self.stop_conditions = stop_conditions()
        self.prompts_from_taskset = False  # load_task reads taskset_rows() for the run's prompts (build() decides)
        self._serving: contextlib.AbstractAsyncContextManager | None = None
        self._users = 0
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def taskset_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        return taskset_rows(self.env, limit)

    def task(self, row: dict[str, Any]):
        fields = {k: v for k, v in row.items() if k in self._data_cls.model_fields}
        return self._task_cls(self._data_cls.model_validate(fields), self.env.taskset.config.task)

    def context(self, episode: EpisodeHandle, seed: int):
        from verifiers.v1 import ModelContext, Sampling, TrainClientConfig

        base_url = episode.base_url
        client = TrainClientConfig(
            base_url=base_url,
            api_key_var="GRPO_TRAINER_UNUSED_KEY",  # the episode's key is the Authorization header below
            headers={"Authorization": f"Bearer {episode.api_key}"},
            renderer_model_name=self._tokenizer_dir.name,
            renderer=self.renderer,
        )
        sampling = Sampling(max_tokens=self.max_tokens)
        return ModelContext(model=episode.model or self.model_name, client=client, sampling=sampling)

    def _lock(self) -> asyncio.Lock:
        """This loop's lock for `_enter`/`_exit`: the run's training and evaluation play on loops of their own
        (one after the other), and an asyncio lock is bound to the loop it first waited on. The same holds for
        renderers' module-level lock around its `GET /v1/models` lookup (renderers/client.py, 0.1.12): a new
        endpoint (evaluation's) looked up on a new loop with episodes waiting on it fails every one of them with
        "bound to a different event loop", so it is replaced once its loop is not this one."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:
            self._gate = (loop, asyncio.Lock())
            from renderers import client as renderers_client

            bound = getattr(renderers_client, "_max_prompt_len_lock", None)
            if isinstance(bound, asyncio.Lock) and getattr(bound, "_loop", None) not in (None, loop):
                renderers_client._max_prompt_len_lock = asyncio.Lock()
        return self._gate[1]

    async def _enter(self) -> None:
        """`env.serving()` is held while any episode plays: opened by the first, closed by the last (so each
        step's per-episode clients are closed with it). Not the engine's once-per-run `serving()`: evaluation
        plays the same environment object on another loop, and verifiers keeps the serving resources on it."""
        async with self._lock():
            if self._users == 0:
                self._serving = self.env.serving()
                await self._serving.__aenter__()
            self._users += 1

    async def _exit(self) -> None:
        async with self._lock():
            self._users -= 1
            if self._users == 0 and self._serving is not None:
                serving, self._serving = self._serving, None
                await serving.__aexit__(None, None, None)

    async def play(self, row: dict, episode: EpisodeHandle, seed: int) -> Played:
        task = self.task(row)
        (slot,) = self.env.slots(task, 1)
        await self._enter()
        try:
            result = await self.env.run_slot(slot, self.context(episode, seed))
        finally:
            await self._exit()
        for trace in result.traces:  # the episode's key rode in the client config: keep it off what is returned
            client = trace.agent.config.client
            if client is not None and "Authorization" in client.headers:
                client.headers = {k: v for k, v in client.headers.items() if k != "Authorization"}
        return played(result)

    def close(self) -> None:
        self._tokenizer_dir.cleanup()


def taskset_gives_rows(cfg) -> bool:
    """Whether the run's prompts are the taskset's: `data.source` not given explicitly (left out of the config,
    so at its default `builtin:arithmetic`). Writing `data: {source: builtin:arithmetic}` counts as given."""
    return "source" not in cfg.data.model_fields_set


def build(cfg) -> PlayerEnvironment:
    """environments.KINDS["verifiers"]: the configured environment as the agent engine's player. The taskset's
    rows are the run's prompts unless `data.source` was given explicitly (producer-side: `taskset_rows`)."""
    from ..models import load_tokenizer

    env_cfg = cfg.environment
    player = VerifiersPlayer(
        env_cfg.verifiers,
        load_tokenizer(cfg.model),
        max_tokens=cfg.rollout.max_completion_length,
        max_turns=env_cfg.max_turns,
        load_limit=env_cfg.step_timeout,
    )
    player.prompts_from_taskset = taskset_gives_rows(cfg)  # decided here: evaluation's DataConfig is a copy
    return PlayerEnvironment(player)


def played(episode) -> Played:
    """A finished verifiers `Episode` as the producer's `Played`."""
    traces = [t for t in episode.traces if t.agent.trainable]
    counters: dict[str, float] = {"verifiers/errors": float(len(episode.errors) + sum(len(t.errors) for t in traces))}
    branches: list[Branch] = []
    for trace in traces:
        counters["verifiers/turns"] = counters.get("verifiers/turns", 0.0) + trace.num_turns
        counters["verifiers/tokens"] = counters.get("verifiers/tokens", 0.0) + trace.num_output_tokens
        for name, reward in trace.rewards.items():
            if reward is not None:
                counters[f"verifiers/reward/{name}"] = reward.score
        for name, value in trace.metrics.items():
            if value is not None:
                counters[f"verifiers/metric/{name}"] = float(value)
        for branch in trace.branches:
            if not branch.trainable:
                continue
            sample = branch_sample(branch.token_ids, branch.sampled_mask, branch.logprobs, len(branch.calls))
            if sample is not None:
                branches.append(sample)
    counters["verifiers/branches"] = float(len(branches))
    ok = bool(episode.ok) and bool(traces) and all(t.ok for t in traces)
    stop_condition = traces[-1].stop_condition if traces else None
    if not ok:
        errors = [*episode.errors, *(e for t in traces for e in t.errors)]
        last = errors[-1] if errors else None
        error = f"{last.type}: {last.message}" if last is not None else "the episode did not complete"
        if not traces:
            error = "the environment ran no trainable agent"
        return Played(None, branches, None, False, error.splitlines()[0][:500], stop_condition, counters)
    reward = sum(t.reward for t in traces) / len(traces)
    messages = (
        [m.model_dump(mode="json", exclude_none=True) for m in traces[-1].branches[-1].messages]
        if traces[-1].branches
        else None
    )
    return Played(reward, branches, messages, True, None, stop_condition, counters)
