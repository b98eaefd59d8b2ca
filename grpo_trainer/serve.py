"""`python -m grpo_trainer serve CONFIG [overrides] [--port N] [--tensor-parallel-size N] [-- VLLM_ARGS]`.

Starts vLLM's OpenAI-compatible server for the config's model with exactly the flags `rollout.engine:
vllm_server` needs, as `trl vllm-serve` does for TRL, so nobody assembles them by hand:

- `--logprobs-mode processed_logprobs`: the sampled tokens' log-probs under the temperature they were drawn
  with (the engine refuses a server without it).
- `--dtype`: the trainer's (`rollout.vllm.dtype`, `auto` = `model.dtype`); vLLM's own `auto` would run a
  float32 checkpoint in bfloat16.
- the weight push of `rollout.vllm_server.weight_sync`: `--weight-transfer-config '{"backend": "gloo"}'`
  (or "nccl"), or for `disk` our worker extension; `VLLM_SERVER_DEV_MODE=1` for the RL endpoints (none for
  `none`).
- `--seed`, `--max-model-len`, `--enforce-eager`, `--tensor-parallel-size`, the KV cache size from
  `rollout.vllm`; `builtin:` model names resolved to their cached folders; host and port from the (first)
  server URL in the config unless given.

Anything after `--` goes to vLLM as is. `--dry-run` prints the command instead of running it. The command
is `python -m vllm.entrypoints.openai.api_server`, which works where `vllm serve` does and also on vLLM's
CPU build, whose `vllm serve` fails (docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.parse

from .config import Config

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # as the colocate engine: plenty for small models, RAM stays free


def serve_command(cfg: Config, *, host: str | None = None, port: int | None = None,
                  tensor_parallel_size: int | None = None, vllm_args: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(command line, environment variables to add) for a server the config's vllm_server engine can use."""
    from .builtin import resolve_model_path

    server, engine = cfg.rollout.vllm_server, cfg.rollout.vllm
    url = urllib.parse.urlparse(server.server_urls()[0])
    loopback = url.hostname in ("127.0.0.1", "localhost", "::1")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", resolve_model_path(cfg.model.name_or_path),
        "--host", host or (url.hostname if loopback else "0.0.0.0"),  # a remote trainer must reach it
        "--port", str(port or url.port or 8000),
        "--dtype", cfg.model.dtype if engine.dtype == "auto" else engine.dtype,
        "--logprobs-mode", "processed_logprobs",
        "--seed", str(cfg.seed),
        "--tensor-parallel-size", str(tensor_parallel_size or engine.tensor_parallel_size),
    ]  # fmt: skip
    if engine.max_model_len:
        command += ["--max-model-len", str(engine.max_model_len)]
    if engine.enforce_eager:
        command += ["--enforce-eager"]
    kv_bytes = engine.kv_cache_memory_bytes
    if kv_bytes is None and _cpu_only() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES  # on CPU, vLLM's memory share would be a share of the machine's RAM
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if cfg.model.trust_remote_code:
        command += ["--trust-remote-code"]
    if server.weight_sync in ("nccl", "gloo"):
        command += ["--weight-transfer-config", json.dumps({"backend": server.weight_sync})]
    elif server.weight_sync == "disk":
        command += ["--worker-extension-cls", "grpo_trainer.rollout.weight_sync.WorkerWeightSync"]
    env = {} if server.weight_sync == "none" else {"VLLM_SERVER_DEV_MODE": "1"}
    return command + list(vllm_args), env


def _cpu_only() -> bool:
    """Whether vLLM will run on the CPU here (its CPU build, or no GPU)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def shell_line(command: list[str], env: dict[str, str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(part) for part in command])


def serve(cfg: Config, *, host=None, port=None, tensor_parallel_size=None, vllm_args=(), dry_run=False) -> int:
    command, env = serve_command(cfg, host=host, port=port, tensor_parallel_size=tensor_parallel_size,
                                 vllm_args=vllm_args)
    print(shell_line(command, env), file=sys.stdout if dry_run else sys.stderr, flush=True)
    if dry_run:
        return 0
    os.execvpe(command[0], command, {**os.environ, **env})  # the server takes this process over: signals reach it
