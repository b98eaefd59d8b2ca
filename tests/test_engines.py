"""The engines' interface: every engine class and wrapper has the protocol (`generate`, `sync_weights`, `close`),
each engine class's capabilities (rollout/__init__.py) are those its entry in rollout/engines.py declares, a
wrapper has exactly the capabilities of the engine it wraps (plus its own), and the rules that depend on the engine
ask its entry or its capabilities, never its name. None of this imports vLLM itself (the vLLM engine classes
import it only when built). mypy checks the protocol's members and signatures statically too (`make lint`; the
assignments at the end of rollout/registry.py)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
from pathlib import Path

import pytest

from grpo_trainer.rollout import (
    CAPABILITIES,
    EngineWrapper,
    PlansKernels,
    Reconnects,
    Rollout,
    RolloutEngine,
    RunsInLockstep,
    SamplesTrainingModel,
    SamplingSettings,
    Sleeps,
    TakesEpisodes,
    capability,
    lockstep_of,
    needs_episodes,
    needs_weight_sync,
)
from grpo_trainer.rollout.engines import CAPABILITIES as ENTRY_CAPABILITIES
from grpo_trainer.rollout.engines import ENGINE_NAMES, ENGINES, EngineKind, engine_kind, engines_that
from grpo_trainer.rollout.hf import HFEngine
from grpo_trainer.agents.engine import AgentEngine
from grpo_trainer.environments.episodes import EpisodeEngine
from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine
from grpo_trainer.rollout.vllm_server import VLLMServerEngine

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"
CLASSES = {"hf": HFEngine, "vllm_colocate": VLLMColocateEngine, "vllm_server": VLLMServerEngine}
# An entry's declaration -> what the engine class must then be. The entry's other declarations are read only by
# the config's checks and preflight (where the engine samples, whether vLLM runs here or on servers).
AT_RUN_TIME = {
    "needs_weight_sync": lambda cls: not issubclass(cls, SamplesTrainingModel),
    "samples_from_training_model": lambda cls: issubclass(cls, SamplesTrainingModel),
    "can_lose_weights": lambda cls: issubclass(cls, Reconnects),
    "plans_kernels": lambda cls: issubclass(cls, PlansKernels),
}
PROTOCOL = ("generate", "sync_weights", "close")


def capabilities_of(engine) -> set[type]:
    return {kind for kind in CAPABILITIES if capability(engine, kind) is not None}


def test_the_protocol_is_generate_sync_weights_close():
    members = [name for name, value in vars(RolloutEngine).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert sorted(members) == sorted(PROTOCOL)


@pytest.mark.parametrize("cls", [*CLASSES.values(), EpisodeEngine, AgentEngine], ids=lambda c: c.__name__)
def test_every_engine_class_and_wrapper_has_the_protocol_and_implements_its_capabilities(cls):
    """Each protocol method taking at least the protocol's parameters, by name and in order (the loop passes some
    by keyword); each method of each capability it declares its own (the capability's raises NotImplementedError)."""
    for name in PROTOCOL:
        wanted = [p for p in inspect.signature(getattr(RolloutEngine, name)).parameters if p != "self"]
        has = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
        assert has[: len(wanted)] == wanted, f"{cls.__name__}.{name}{has} does not take RolloutEngine.{name}{wanted}"
    for kind in CAPABILITIES:
        if issubclass(cls, kind):
            for name, member in vars(kind).items():
                if callable(member) or isinstance(member, property):
                    assert getattr(cls, name) is not member, f"{cls.__name__} leaves {kind.__name__}.{name} out"


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_each_engine_class_is_what_its_entry_declares(name):
    assert set(CLASSES) == set(ENGINES)  # a new entry needs its class here (and a builder in registry.py)
    kind, cls = ENGINES[name], CLASSES[name]
    for declared, holds in AT_RUN_TIME.items():
        assert holds(cls) is getattr(kind, declared), f"{name}: {declared} is {getattr(kind, declared)} in engines.py"
    assert kind.name == name and engine_kind(name) is kind
    assert not (kind.can_lose_weights and not kind.samples_outside_process)  # only another process can restart
    assert not issubclass(cls, TakesEpisodes) and not issubclass(cls, EngineWrapper)  # samplers: no environment


def test_the_engines_capabilities_are_what_the_loop_relies_on():
    """hf: no push (so no ZeRO-3 gather), lockstep under FSDP, kernels planned, nothing to free or wait for;
    vllm_colocate: pushed to, frees its memory; vllm_server: pushed to, waits for a server that went away."""
    assert {k for k in CAPABILITIES if issubclass(HFEngine, k)} == {SamplesTrainingModel, RunsInLockstep, PlansKernels}
    assert {k for k in CAPABILITIES if issubclass(VLLMColocateEngine, k)} == {Sleeps}
    assert {k for k in CAPABILITIES if issubclass(VLLMServerEngine, k)} == {Reconnects}
    engine = HFEngine(SamplingSettings(eos_token_ids=[0], max_completion_length=2), get_model=lambda: None, pad_token_id=0)
    assert isinstance(engine, RolloutEngine) and not needs_weight_sync(engine) and lockstep_of(engine) is None
    comm = object()
    engine.lockstep = comm
    assert lockstep_of(engine) is comm and not needs_episodes(engine)


def test_an_unknown_engine_or_capability_is_one_line_naming_what_there_is():
    with pytest.raises(ValueError, match="rollout.engine: unknown engine 'sglang' \\(one of hf, vllm_colocate, vllm_server\\)"):
        engine_kind("sglang")
    with pytest.raises(ValueError, match="'fast' is not an engine capability"):
        engines_that("fast")
    assert set(ENTRY_CAPABILITIES) == {f.name for f in dataclasses.fields(EngineKind)} - {"name", "description"}


class Sampler:
    """An engine stand-in that records what it is asked; its capabilities are its classes' (the test's)."""

    def __init__(self):
        self.asked: list[tuple] = []
        self.lockstep = None

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        return Rollout([[1]] * (len(prompt_ids) * num_generations), [True] * (len(prompt_ids) * num_generations))

    def sync_weights(self, model, version=None, gather=None):
        self.asked.append(("sync_weights", model, version, gather))

    def close(self):
        self.asked.append(("close",))


def sampler_with(kinds: tuple[type, ...]) -> Sampler:
    return type("Sampler_" + "_".join(k.__name__ for k in kinds), (Sampler, *kinds), {})()


SAMPLER_CAPABILITIES = [k for k in CAPABILITIES if k is not TakesEpisodes]  # what a sampler may have (no environment)
EVERY_SET = [kinds for n in range(len(SAMPLER_CAPABILITIES) + 1) for kinds in itertools.combinations(SAMPLER_CAPABILITIES, n)]


def _tools_wrapper(inner):
    """The episode loop around `inner`, built as the run builds it (`with_environment`, the tools environment)."""
    from grpo_trainer.config import ModelConfig, load_config
    from grpo_trainer.environments.episodes import with_environment
    from grpo_trainer.environments.tools import Tool, ToolBox
    from grpo_trainer.environments.tools_env import ToolsEnvironment
    from grpo_trainer.models import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    box = ToolBox([Tool("add", {}, lambda a, b: str(a + b))], timeout=5, output_chars=100)
    sampling = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=4)
    return with_environment(inner, tokenizer, load_config(None, []), sampling, ToolsEnvironment(box))


class Plain(EngineWrapper):
    """The least a new wrapper writes: its own `generate`."""

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        return self.inner.generate(prompt_ids, num_generations, seeds=seeds, max_tokens=max_tokens)


@pytest.mark.parametrize("kinds", EVERY_SET, ids=lambda kinds: "+".join(k.__name__ for k in kinds) or "none")
def test_a_wrapper_has_exactly_the_capabilities_of_the_engine_it_wraps(tiny_model_path, kinds):
    """For every set of capabilities a sampler may have: a bare new wrapper, the episode loop around it, and a
    wrapper around that each have the wrapped sampler's capabilities, found on the sampler itself (so a call
    reaches it), and no other but their own (the episode loop takes episodes); what the loop derives from them
    (push or not, lockstep) is the sampler's. Pushes and closing reach the sampler through every layer."""
    inner = sampler_with(kinds)
    for wrapper, own in ((Plain(inner), set()), (_tools_wrapper(inner), {TakesEpisodes}),
                         (Plain(_tools_wrapper(inner)), {TakesEpisodes})):
        assert isinstance(wrapper, RolloutEngine)
        assert capabilities_of(wrapper) == set(kinds) | own
        assert all(capability(wrapper, kind) is inner for kind in kinds)
        assert needs_weight_sync(wrapper) is (SamplesTrainingModel not in kinds)
        inner.lockstep = object()
        assert lockstep_of(wrapper) is (inner.lockstep if RunsInLockstep in kinds else None)
        model, gather = object(), object()
        wrapper.sync_weights(model, version=3, gather=gather)
        wrapper.close()
        assert inner.asked == [("sync_weights", model, 3, gather), ("close",)]
        inner.asked.clear()


def test_the_episode_loop_wants_episodes_only_for_environments_that_record_them(tiny_model_path):
    wrapper = _tools_wrapper(sampler_with(()))
    assert type(wrapper) is EpisodeEngine and not needs_episodes(wrapper)  # environment.tools: no EpisodeSpec
    wrapper.settings = dataclasses.replace(wrapper.settings, record=True)
    assert needs_episodes(wrapper) and needs_episodes(Plain(wrapper))


def test_callers_ask_for_capabilities_through_wrappers():
    """`isinstance(engine, Kind)` would miss a wrapped engine's capability: outside rollout/__init__.py the
    package asks `capability(engine, Kind)` (or a helper built on it)."""
    names = "|".join(kind.__name__ for kind in CAPABILITIES)
    pattern = re.compile(rf"isinstance\([^)]*\b({names})\b")
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).as_posix() != "rollout/__init__.py"
             for n, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_no_module_tells_engines_apart_by_name_outside_the_registry():
    """`grep -rnE 'engine (==|!=|in)' grpo_trainer`, and comparisons with an engine's name, find only the registry:
    a rule that depends on the engine asks its entry (rollout/engines.py)."""
    names = "|".join(ENGINE_NAMES)
    pattern = re.compile(rf"engine (==|!=|in)|(==|!=) *[\"']({names})[\"']|[\"']({names})[\"'] *(==|!=)")
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name not in ("registry.py", "engines.py")
             for n, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_rules_that_depend_on_the_engine_ask_its_entry(monkeypatch):
    """Give vllm_colocate the capabilities of another engine: the config's rule on asynchronous rollouts, the Python
    API's rule on model objects, and preflight's vLLM check follow the entry."""
    from grpo_trainer import api, preflight
    from grpo_trainer.config import load_config
    from grpo_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.max_staleness 1 needs rollout.engine vllm_server: the vllm_colocate"):
        load_config(None, ["rollout.engine=vllm_colocate", "rollout.max_staleness=1"])
    cfg = load_config(None, ["rollout.engine=vllm_colocate"])
    with pytest.raises(ConfigError, match="a model given as an object samples with rollout.engine=hf"):
        api._check_objects_fit(cfg, {"model": object()})
    checked = []
    monkeypatch.setattr(preflight, "_check_vllm_can_run", checked.append)
    preflight.preflight(cfg)
    assert checked == [cfg]

    kind = ENGINES["vllm_colocate"]
    monkeypatch.setitem(ENGINES, "vllm_colocate", dataclasses.replace(
        kind, samples_outside_process=True, samples_from_training_model=True, vllm_in_process=False))
    assert load_config(None, ["rollout.engine=vllm_colocate", "rollout.max_staleness=1"]).rollout.max_staleness == 1
    api._check_objects_fit(cfg, {"model": object()})
    preflight.preflight(cfg)
    assert checked == [cfg]  # not checked again
