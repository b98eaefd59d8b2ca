"""Group sampling (`rollout:`) and the engines' own sections (`rollout.hf`, `rollout.vllm`, `rollout.vllm_server`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from ..rollout.engines import ENGINE_NAMES, ENGINES, engines_that
from .base import CHANGES_MEANING, _Section

if TYPE_CHECKING:  # a Literal built from a registry's names at run time is a plain str to a type checker
    EngineName = str
else:
    EngineName = Literal[ENGINE_NAMES]  # rollout/engines.py: each engine's entry declares what it can do


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
    push_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds one weight push may take, data plane included (the gloo/nccl broadcast and the servers' "
        "reload, the disk write and reload, a LoRA adapter's load); a push that does not complete stops the run in "
        "one line naming the server, the method and the step, the last checkpoint intact. None: sized from the "
        "pushed bytes, 60 s + bytes / 25 MiB/s (docs/vllm.md, 'Push deadlines').",
    )
    push_probe: bool = Field(
        True,
        description="After each push, prove the new weights are live before sampling on them: every server's "
        "log-probs of a fixed 8-token probe against the trainer's, within push_probe_tolerance; a mismatch stops "
        "the run in one line. False (explicitly) skips it; not run under DeepSpeed ZeRO-3 (docs/vllm.md).",
    )
    push_probe_tolerance: float | None = Field(
        None,
        gt=0,
        description="The probe's limit on the mean absolute log-prob difference, in nats. None: by the pushed "
        "weights' dtype: 1e-3 for float32, 0.05 for float16, 0.1 for bfloat16 (docs/vllm.md).",
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

    @property
    def sampler_logprobs_differ(self) -> bool:
        """The engine's sampler log-probs differ from the trainer's (vLLM): what `loss.tis_cap: auto` and the
        mismatch metrics go by (rollout/engines.py declares it per engine)."""
        return ENGINES[self.engine].sampler_logprobs_differ

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
        return self

    @model_validator(mode="after")
    def _min_p_alone(self):
        if self.min_p > 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError(
                "rollout.min_p cannot be combined with rollout.top_p or rollout.top_k: transformers applies min_p after "
                "them and vLLM before, so the engines would sample from different distributions"
            )
        return self
