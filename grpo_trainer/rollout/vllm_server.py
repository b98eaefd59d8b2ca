"""Group sampling on an external vLLM server (`vllm serve`), over HTTP.

The server is started separately (see docs/vllm.md for the exact command), on
other GPUs or another machine; every trainer rank sends its own prompts. Written
against vLLM 0.32 and its OpenAI-compatible API (tested with the CPU build).

- generate: `POST /v1/completions` with token-id prompts, `n = G`,
  `logprobs: 0` (the sampled token's log-prob), `return_token_ids: true` (vLLM's
  extension: the completion as token ids, no re-tokenisation), `stop_token_ids`
  (the trainer's EOS ids), a per-prompt seed. Start the server with
  `--logprobs-mode processed_logprobs` so the log-probs are those of the
  temperature-scaled distribution the tokens were drawn from (as in
  vllm_colocate.py); the engine checks this at start-up where the server tells.
- Health: `GET /health` is polled at start for up to `startup_timeout` seconds;
  a server that is down, or does not answer, gives a `ConnectionError` naming the
  URL and what to run, instead of a hang. Every request has `timeout` seconds.
- Weight push, `weight_sync="disk"` (portable: no NCCL, works on CPU): the
  trainer writes its merged weights as safetensors into `weights_dir` (a folder
  the server can read: same machine or a shared file system), then calls
  `POST /collective_rpc {"method": "grpo_reload_weights", "kwargs": {"weights_path": weights_dir}}`
  (vLLM's in-place reload, through our worker extension that keeps tied
  embeddings right, see weight_sync.WorkerWeightSync) and `POST /reset_prefix_cache`.
  So the server must run with `VLLM_SERVER_DEV_MODE=1` (these endpoints exist
  only then: they let any client reload weights and reset caches, keep such a
  server on a trusted network) and `--worker-extension-cls
  grpo_trainer.rollout.weight_sync.WorkerWeightSync` (grpo-trainer installed in
  the server's environment).
- NCCL pushes (vLLM 0.32's `/init_weight_transfer_engine` + `/update_weights`)
  are not implemented; the config refuses `weight_sync: nccl` at load.
- With several trainer ranks, only the main process pushes weights
  (`is_main_process`); the trainer must put a barrier after `sync_weights` so
  no rank samples before the push is done.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import Rollout, SamplingSettings
from .weight_sync import save_weights

if TYPE_CHECKING:
    from ..config import VLLMServerConfig


class ServerError(RuntimeError):
    """The vLLM server answered with an error, or an endpoint is missing."""


class VLLMServerEngine:
    needs_weight_sync = True  # the server holds its own copy of the weights

    def __init__(
        self,
        sampling: SamplingSettings,
        settings: VLLMServerConfig | None = None,
        *,
        seed: int | None = 0,
        model_name: str | None = None,
        is_main_process: bool = True,
    ):
        """`settings` is the `rollout.vllm_server` section (defaults: a server on 127.0.0.1:8000)."""
        from ..config import VLLMServerConfig

        settings = settings or VLLMServerConfig()
        self.base_url = settings.base_url.rstrip("/")
        self.eos_token_ids = list(sampling.eos_token_ids)
        self.max_completion_length = sampling.max_completion_length
        self.temperature, self.top_p, self.top_k = sampling.temperature, sampling.top_p, sampling.top_k
        self.min_p, self.repetition_penalty = sampling.min_p, sampling.repetition_penalty
        self.stop = list(sampling.stop)
        self.seed = seed
        self.timeout = settings.timeout
        self.weight_sync = settings.weight_sync
        self.weights_dir = (
            Path(settings.weights_dir) if settings.weights_dir else Path(tempfile.gettempdir()) / "grpo_trainer_vllm_weights"
        )
        self.is_main_process = is_main_process
        self.batch_size = sampling.batch_size
        self._calls = 0
        self.wait_until_healthy(settings.startup_timeout)
        self.model_name = model_name or self._first_model()

    # ------------------------------------------------------------------ http
    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
                raise ServerError(
                    f"vLLM server at {self.base_url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(needed for the weight push, see docs/vllm.md)"
                ) from None
            if path == "/collective_rpc" and "grpo_reload_weights" in detail:
                raise ServerError(
                    f"vLLM server at {self.base_url} lacks the weight-sync extension: start it with "
                    f"--worker-extension-cls grpo_trainer.rollout.weight_sync.WorkerWeightSync: {detail}"
                ) from None
            raise ServerError(f"vLLM server {method} {url} failed: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ConnectionError(
                f"vLLM server at {self.base_url} did not answer {method} {path} within {timeout or self.timeout:g}s: "
                f"{reason}"
            ) from None
        return json.loads(raw) if raw else None

    def wait_until_healthy(self, startup_timeout: float) -> None:
        """Poll GET /health until it answers 200, or raise ConnectionError after `startup_timeout` seconds."""
        deadline = time.monotonic() + startup_timeout
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self._request("GET", "/health", timeout=max(0.1, min(5.0, left)))
                return
            except (ConnectionError, ServerError) as e:
                last = e
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        raise ConnectionError(
            f"rollout.engine=vllm_server: no healthy vLLM server at {self.base_url} after {startup_timeout:g}s "
            f"(last error: {last}). Start one first, e.g. `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
            f"--host 127.0.0.1 --port 8000 --logprobs-mode processed_logprobs` (docs/vllm.md)."
        )

    def _first_model(self) -> str:
        models = self._request("GET", "/v1/models")
        data = (models or {}).get("data") or []
        if not data:
            raise ServerError(f"vLLM server at {self.base_url} serves no model (/v1/models is empty)")
        return data[0]["id"]

    # ------------------------------------------------------------------ sampling
    def _completion_body(self, prompts: list[list[int]], n: int, seed: int | None = None, max_tokens: int | None = None) -> dict:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": [list(p) for p in prompts],
            "n": n,
            "max_tokens": max_tokens or self.max_completion_length,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else 0,
            # Always sent: the server fills unset ones from the checkpoint's generation config
            # (Qwen2.5-Instruct: repetition_penalty 1.05), which the config did not ask for.
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_p": self.min_p,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": self.eos_token_ids,
            "stop": self.stop,
            "skip_special_tokens": False,
        }
        if seed is not None:
            body["seed"] = seed % (1 << 62)
        elif self.seed is not None:
            body["seed"] = ((self.seed * 1_000_003 + self._calls) * 1_000_003) % (1 << 62)
        return body

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None,
                 max_tokens: int | None = None) -> Rollout:
        step = self.batch_size or len(prompt_ids)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        logprobs: list[list[float]] = []
        eos = set(self.eos_token_ids)
        for start in range(0, len(prompt_ids), step):
            chunk = prompt_ids[start : start + step]
            # One request per prompt would give each its own seed; one request for the chunk is
            # faster. vLLM seeds the n samples of a prompt seed..seed+n-1, the same for every
            # prompt of a request: so send one request per prompt when seeded.
            # The requests run concurrently: the server batches them.
            seeded = self.seed is not None or seeds is not None
            groups = [[p] for p in chunk] if seeded else [chunk]
            bodies = []
            for i, group in enumerate(groups):
                prompt_seed = seeds[start + i] if seeds is not None else None
                bodies.append(self._completion_body(group, num_generations, prompt_seed, max_tokens))
                self._calls += 1
            with ThreadPoolExecutor(max_workers=min(32, len(bodies))) as pool:
                responses = list(pool.map(lambda b: self._request("POST", "/v1/completions", b), bodies))
            for group, resp in zip(groups, responses):
                choices = sorted(resp["choices"], key=lambda c: c["index"])
                if len(choices) != len(group) * num_generations:
                    raise ServerError(f"vLLM server returned {len(choices)} choices for {len(group)} x {num_generations}")
                for choice in choices:
                    ids = list(choice.get("token_ids") or [])
                    lps = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
                    hits = [i for i, t in enumerate(ids) if t in eos]
                    if hits:
                        ids, lps = ids[: hits[0] + 1], lps[: hits[0] + 1]
                    completions.append(ids)
                    truncated.append(not hits and choice.get("finish_reason") != "stop")  # "stop": a stop string
                    logprobs.append(lps)
        return Rollout(completion_ids=completions, truncated=truncated, sampling_logprobs=logprobs)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        if not self.is_main_process or self.weight_sync == "none":
            return
        self.push_weights_disk(model)

    def push_weights_disk(self, model: torch.nn.Module) -> None:
        """Write merged weights to `weights_dir` and have the server reload them in place."""
        save_weights(model, self.weights_dir)
        self.reload_from(self.weights_dir)

    def reload_from(self, folder: str | os.PathLike) -> None:
        """Ask the server to reload its weights, in place, from a folder of safetensors it can read."""
        self._request(
            "POST", "/collective_rpc", {"method": "grpo_reload_weights", "kwargs": {"weights_path": str(Path(folder).resolve())}}
        )
        self._request("POST", "/reset_prefix_cache")

    def sleep(self) -> None:
        """Nothing to free here: the server's memory is on its own machine or GPUs."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing to release: the server outlives the trainer."""
