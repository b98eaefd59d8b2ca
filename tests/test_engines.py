"""The engines' interface: every engine class and the tools wrapper have every member of `RolloutEngine`, each
class declares the capabilities of its entry in rollout/engines.py, the wrapper forwards each capability, and the
rules that depend on the engine ask its entry, never its name. None of this imports vLLM itself (the vLLM engine
classes import it only when built). mypy checks the members and signatures statically too (`make lint`; the
assignments at the end of rollout/registry.py)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from grpo_trainer.rollout import Rollout, RolloutEngine, SamplingSettings
from grpo_trainer.rollout.engines import CAPABILITIES, ENGINE_NAMES, ENGINES, EngineKind, engine_kind, engines_that
from grpo_trainer.rollout.hf import HFEngine
from grpo_trainer.agents.engine import AgentEngine
from grpo_trainer.environments.episodes import EpisodeEngine
from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine
from grpo_trainer.rollout.vllm_server import VLLMServerEngine

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"
CLASSES = {"hf": HFEngine, "vllm_colocate": VLLMColocateEngine, "vllm_server": VLLMServerEngine}
PROTOCOL_CAPABILITIES = ("needs_weight_sync", "samples_outside_process", "can_lose_weights")  # the class's and the entry's


def protocol_members() -> tuple[list[str], list[str]]:
    """(attributes, methods) the protocol declares."""
    attributes = [name for name, value in vars(RolloutEngine).items() if isinstance(value, property)]
    methods = [name for name, value in vars(RolloutEngine).items() if inspect.isfunction(value) and not name.startswith("_")]
    return attributes, methods


def test_the_protocol_declares_what_the_loop_asks():
    attributes, methods = protocol_members()
    assert {"needs_weight_sync", "samples_outside_process", "can_lose_weights", "lockstep"} <= set(attributes)
    assert {"generate", "sync_weights", "reconnect", "plan_kernels", "use_kernels", "sleep", "wake_up", "close"} <= set(methods)


@pytest.mark.parametrize("cls", [*CLASSES.values(), EpisodeEngine, AgentEngine], ids=lambda c: c.__name__)
def test_every_engine_class_and_the_tools_wrapper_have_every_member_of_the_protocol(cls):
    """Each attribute on the class itself (an engine's capabilities do not depend on the instance), each method
    taking at least the protocol's parameters, by name and in order (the loop passes some by keyword)."""
    attributes, methods = protocol_members()
    missing = [name for name in attributes + methods if not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing} of RolloutEngine"
    for name in methods:
        wanted = [p for p in inspect.signature(getattr(RolloutEngine, name)).parameters if p != "self"]
        has = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
        assert has[: len(wanted)] == wanted, f"{cls.__name__}.{name}{has} does not take RolloutEngine.{name}{wanted}"


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_each_engine_class_declares_the_capabilities_of_its_entry(name):
    assert set(CLASSES) == set(ENGINES)  # a new entry needs its class here (and a builder in registry.py)
    kind = ENGINES[name]
    for capability in PROTOCOL_CAPABILITIES:
        assert getattr(CLASSES[name], capability) is getattr(kind, capability), f"{name}: {capability}"
    assert kind.name == name and engine_kind(name) is kind
    assert not (kind.can_lose_weights and not kind.samples_outside_process)  # only another process can restart


def test_an_unknown_engine_or_capability_is_one_line_naming_what_there_is():
    with pytest.raises(ValueError, match="rollout.engine: unknown engine 'sglang' \\(one of hf, vllm_colocate, vllm_server\\)"):
        engine_kind("sglang")
    with pytest.raises(ValueError, match="'fast' is not an engine capability"):
        engines_that("fast")
    assert set(CAPABILITIES) == {f.name for f in dataclasses.fields(EngineKind)} - {"name", "description"}


class Inner:
    """An engine stand-in whose capabilities are the test's, and which records what it is asked."""
    needs_episodes = False  # a sampler: no environment

    def __init__(self, **capabilities):
        for name, value in capabilities.items():
            setattr(self, name, value)
        self.asked: list[tuple] = []

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        return Rollout([[1]] * (len(prompt_ids) * num_generations), [True] * (len(prompt_ids) * num_generations))

    def reconnect(self, timeout):
        self.asked.append(("reconnect", timeout))
        return timeout > 1

    def sync_weights(self, model, version=None, gather=None):
        self.asked.append(("sync_weights", model, version, gather))

    def plan_kernels(self, max_rows, max_context, recorded=None, decide=True):
        self.asked.append(("plan_kernels", max_rows, max_context, recorded, decide))
        return {"a": "b"}

    def use_kernels(self, plan):
        self.asked.append(("use_kernels", plan))

    def sleep(self):
        self.asked.append(("sleep",))

    def wake_up(self):
        self.asked.append(("wake_up",))

    def close(self):
        self.asked.append(("close",))


@pytest.mark.parametrize("value", [True, False])
def test_the_tools_wrapper_forwards_every_capability_and_call_of_the_engine_it_wraps(tiny_model_path, value):
    """Each capability the wrapped engine's (both values: a wrapper with its own constant would fail one), each
    call forwarded with its arguments; with the wrapper the engine still satisfies the protocol at run time. The
    wrapper is built as the run builds it (`with_environment`, around the tools environment)."""
    from grpo_trainer.config import ModelConfig, load_config
    from grpo_trainer.environments.episodes import with_environment
    from grpo_trainer.environments.tools import Tool, ToolBox
    from grpo_trainer.environments.tools_env import ToolsEnvironment
    from grpo_trainer.models import load_tokenizer

    lockstep = object() if value else None
    inner = Inner(needs_weight_sync=value, samples_outside_process=value, can_lose_weights=value, lockstep=lockstep)
    tokenizer = load_tokenizer(ModelConfig())
    box = ToolBox([Tool("add", {}, lambda a, b: str(a + b))], timeout=5, output_chars=100)
    sampling = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=4)
    engine = with_environment(inner, tokenizer, load_config(None, []), sampling, ToolsEnvironment(box))
    assert type(engine) is EpisodeEngine and engine.engine is inner
    assert isinstance(engine, RolloutEngine) and isinstance(inner, RolloutEngine)
    for capability in PROTOCOL_CAPABILITIES:
        assert getattr(engine, capability) is value, capability
    assert engine.lockstep is lockstep
    model, gather = object(), object()
    assert engine.reconnect(2.0) and not engine.reconnect(0.5)
    engine.sync_weights(model, version=3, gather=gather)
    assert engine.plan_kernels(8, 64, {"x": "y"}, decide=False) == {"a": "b"}
    engine.use_kernels({"a": "b"})
    engine.sleep()
    engine.wake_up()
    engine.close()
    assert inner.asked == [("reconnect", 2.0), ("reconnect", 0.5), ("sync_weights", model, 3, gather),
                           ("plan_kernels", 8, 64, {"x": "y"}, False), ("use_kernels", {"a": "b"}), ("sleep",),
                           ("wake_up",), ("close",)]


def test_the_hf_engine_satisfies_the_protocol_at_run_time_and_cannot_lose_weights():
    engine = HFEngine(SamplingSettings(eos_token_ids=[0], max_completion_length=2), get_model=lambda: None, pad_token_id=0)
    assert isinstance(engine, RolloutEngine)
    assert engine.lockstep is None and not engine.reconnect(10.0)


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
