"""The engines `rollout.engine` may name, and what each can do, declared without importing any of them.

The config's checks, preflight and the Python API ask an engine's entry what it can do (`ENGINES[name]`), never
its name: a rule such as "asynchronous rollouts need an engine that samples outside the training process" is
written once, against the capability, and holds for an engine added later. Declaring the capabilities here,
apart from the engine classes, keeps loading a config cheap: nothing from vLLM (or torch) is imported to
validate one. What the loop asks at run time the classes declare by their capability classes
(rollout/__init__.py: `SamplesTrainingModel`, `Reconnects`, `PlansKernels`, ...); tests/test_engines.py checks that
the two agree. `registry.build_engine` builds the
engine an entry names.

Deliberately not here: the engines' settings (config/rollout.py, one section each) and how they are built (registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineKind:
    """One engine's declared capabilities (those the loop also asks at run time are the engine class's too:
    tests/test_engines.py's AT_RUN_TIME)."""

    name: str
    description: str
    needs_weight_sync: bool  # keeps its own copy of the weights: the trainer pushes them after each update
    samples_outside_process: bool  # sampling can overlap the update (rollout.max_staleness >= 1)
    can_lose_weights: bool  # its sampler can restart without the pushed weights (the queue pushes them again)
    samples_from_training_model: bool  # a model given to the Python API as an object can sample
    plans_kernels: bool  # samples with this package's decode loop, whose kernels are planned per machine
    vllm_in_process: bool  # runs vLLM in the trainer's processes: vLLM is needed here, and its CPU build's limits hold
    vllm_servers: bool  # samples on the servers of rollout.vllm_server: `train` waits for them before loading anything
    # Samples with its own copy of the weights and its own kernels: its log-probs differ from the trainer's, so
    # `loss.tis_cap: auto` turns the rollout correction on and the mismatch is logged (docs/async.md).
    sampler_logprobs_differ: bool


ENGINES: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind(
            "hf",
            "transformers generate (this package's decode loop), from the training model itself",
            needs_weight_sync=False,
            samples_outside_process=False,
            can_lose_weights=False,
            samples_from_training_model=True,
            plans_kernels=True,
            vllm_in_process=False,
            vllm_servers=False,
            sampler_logprobs_differ=False,
        ),
        EngineKind(
            "vllm_colocate",
            "vLLM in each training process",
            needs_weight_sync=True,
            samples_outside_process=False,
            can_lose_weights=False,
            samples_from_training_model=False,
            plans_kernels=False,
            vllm_in_process=True,
            vllm_servers=False,
            sampler_logprobs_differ=True,
        ),
        EngineKind(
            "vllm_server",
            "external vLLM servers",
            needs_weight_sync=True,
            samples_outside_process=True,
            can_lose_weights=True,
            samples_from_training_model=False,
            plans_kernels=False,
            vllm_in_process=False,
            vllm_servers=True,
            sampler_logprobs_differ=True,
        ),
    )
}

ENGINE_NAMES = tuple(ENGINES)  # what rollout.engine accepts
CAPABILITIES = tuple(f.name for f in fields(EngineKind) if f.type == "bool")


def engine_kind(name: str) -> EngineKind:
    """The entry of engine `name`; ValueError naming rollout.engine and the engines there are."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine: unknown engine {name!r} (one of {', '.join(ENGINES)})") from None


def engines_that(capability: str) -> list[str]:
    """The names of the engines that declare `capability` (for messages that say which engine would do)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability!r} is not an engine capability (one of {', '.join(CAPABILITIES)})")
    return [kind.name for kind in ENGINES.values() if getattr(kind, capability)]


# ----------------------------------------------------------------------------- LoRA adapters on vLLM

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values (a ceiling)


def vllm_lora_rank(r: int) -> int | None:
    """The smallest `max_lora_rank` vLLM accepts that holds rank `r`; None above its largest."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= r), None)


def lora_config_refusal(lora_rank: int | None, engine: str, weights_dir: str | None) -> str | None:
    """Why vLLM cannot take a run's adapter, as far as its config alone tells (no LoRA, a rank above vLLM's, no
    weights_dir for servers); None if it may. Here, beside the engines' entries, so that the config can refuse
    `rollout.lora_sync=adapter` when it loads (validate, serve --dry-run, train before it waits for a server)
    without importing the weight-sync code (rollout/lora_sync.py makes the full decision)."""
    if lora_rank is None:
        return "the model has no LoRA adapters (model.lora is not set)"
    if vllm_lora_rank(lora_rank) is None:
        return f"model.lora.r={lora_rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    if engine_kind(engine).vllm_servers and not weights_dir:
        return (
            "rollout.vllm_server.weights_dir is not set: adapters reach a server as a folder it reads, so name "
            "one both trainer and servers can read"
        )
    return None
