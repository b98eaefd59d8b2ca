"""Group sampling on external vLLM servers, over HTTP; weights pushed with vLLM's own RL protocol.

The servers are started separately, on other GPUs or machines: `python -m grpo_trainer serve CONFIG`
starts one with exactly the flags this engine needs (docs/vllm.md also gives the raw command). Written
against vLLM 0.32 and tested for real against its CPU build.

- Servers: `rollout.vllm_server.urls` (or `base_url`, the one-server case). Every trainer rank sends its
  own prompts; a generate call's requests (one per prompt when seeded) are spread over the servers in
  turn (data-parallel generation). A prompt's group is drawn from that prompt's seed alone
  (vllm_sampling.request_seed), so the completions do not depend on how many servers there are.
- generate: `POST /v1/completions` with token-id prompts, `n = G`, the sampled token's log-prob,
  `return_token_ids` (vLLM's extension: no re-tokenisation), the trainer's EOS ids as stop tokens; the
  fields and the EOS/truncation rule are vllm_sampling.py's, shared with vllm_colocate.
- Start-up: each server must answer `GET /health` within `startup_timeout` (else a `ConnectionError`
  naming the URL and what to run), serve the same model, and report processed log-probs: the engine
  asks for the two likeliest next tokens at temperatures 1 and 2. Under
  `--logprobs-mode processed_logprobs` the gap between their log-probs halves (they are those of
  logits / T); under vLLM's default `raw_logprobs` it does not move, and the importance weights would
  silently use the wrong distribution: such a server is refused in one line. Only what may still come up
  is waited for (the connection refused or timed out: a server starting); an address that answers
  something else (an HTTP 4xx to `/health`, an answer that is not vLLM's JSON) is refused at once, naming
  the URL and what it answered (`NotAVLLMServer`). `check_servers` runs these checks before the trainer
  loads its model (preflight.py); impossible URLs are refused when the config loads (config/rollout.py).
- Weight push (`weight_sync`), main process only, every server at once, each push with a weight
  version (`weight_version`: the last one pushed, None before any):
  - `nccl` (GPU) and `gloo` (CPU, or GPUs through host memory): vLLM's RL API
    (`/init_weight_transfer_engine` once, then `/start_weight_update`, `/update_weights`,
    `/finish_weight_update` with the version), driven by vLLM's trainer-side engine for the backend
    (`WeightTransferTrainerFactory`; `nccl` is vLLM's own, `gloo` is this package's, gloo_transfer.py).
    One transfer group spans the trainer and every worker of every server, so one broadcast reaches
    them all. The tensors stream from `weight_sync.MergedWeights` in bounded buckets (LoRA merged,
    ZeRO-3 gathered one layer at a time with `gather`).
  - `disk`: merged weights written as safetensors into `weights_dir` (a folder every server can read),
    then reloaded in place through our worker extension (`POST /collective_rpc grpo_reload_weights`).
    Without `weights_dir`, a fresh folder of the engine's own under the temp directory (`TMPDIR`, else
    /tmp; readable by the trainer's user only), removed when the engine closes or the process exits: two
    runs on one machine never share it. It suits a server on the same machine run by the same user; any
    other set-up names a shared folder in `weights_dir`.
  - `none`: never pushed (the servers keep the weights they started with).
  - LoRA adapters (`rollout.lora_sync`, lora_sync.py; whatever `weight_sync` says but `none`): the adapter is
    written as a new version folder under `weights_dir`, loaded on every server under a new name
    (`/v1/load_lora_adapter`), then our adapters older than the K before it unloaded (K = rollout.max_staleness:
    requests in flight may still name those), and any a crashed run left; requests then ask for it by name. Needs servers started with `--enable-lora` and
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`serve` adds both). Under `lora_sync: auto`, a first push that a
    server refuses (no LoRA, a folder it cannot read, a rank above its `--max-lora-rank`) switches the run to
    merged pushes, logging the server's answer. Ranks other than the main process read the adapter's name
    from the first server after each push (`/v1/models`: the newest, lora_sync.newest_adapter).
  Every push is wrapped in `/pause?mode=wait` (requests in flight finish with the weights they started
  with) and `/resume`, and ends with `/reset_prefix_cache` (cached KV blocks belong to the old weights).
  These endpoints exist only on a server started with `VLLM_SERVER_DEV_MODE=1`: they let any client
  replace the weights, so keep such a server on a trusted network.
- Faults (`reconnect_timeout`): a server that goes away (connection refused or reset) is waited for
  that long. If it does not come back: `ConnectionError` naming its URL. If it does, it has lost the
  pushed weights: `generate` raises `WeightsLost` (the caller pushes the current weights, then samples
  again; with nothing pushed yet the engine just retries), and `sync_weights` rebuilds the transfer
  group and pushes again (with a ZeRO-3 `gather` it raises `WeightsLost` instead, since a second pass
  needs every rank). A server that restarted between calls is caught by its weight version
  (`GET /weight_info` before sampling and pushing), since a fresh server reports "default".
- Pushes that fail loudly (push_checks.py): every push's data plane runs within `push_timeout` (default sized from
  the pushed bytes) and is then checked by a probe (every server's log-probs of 8 fixed tokens against the
  trainer's, within the dtype's tolerance); either failing raises `PushFailed` (one line: the servers, the method,
  the version), and the servers are marked "incomplete push".
- With several trainer ranks only the main process pushes (`is_main_process`); the others only follow
  the version (and take part in the ZeRO-3 gathers). The trainer puts a barrier after `sync_weights`.
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..deadline import Call, UserCalls
from ..errors import UserError
from . import PushFailed, Reconnects, Rollout, SamplingSettings, ServerGone, ServerUnreachable, WeightsLost
from .lora_sync import (
    ADAPTER_PREFIX,
    Adapter,
    AdapterFolders,
    adapter_slots,
    log_fallback,
    newest_adapter,
    stale_adapters,
)
from .push_checks import (
    default_push_timeout,
    mismatch,
    probe_body,
    probe_tokens,
    pushed_bytes,
    server_logprobs,
    tolerance,
    trainer_logprobs,
    vocab_size,
)
from .vllm_sampling import cut_completion, request_seed, sampling_fields
from .weight_sync import Gather, MergedWeights, address_towards, save_weights

if TYPE_CHECKING:
    from ..config import VLLMServerConfig

logger = logging.getLogger(__name__)

FRESH_VERSION = "default"  # what vLLM 0.32 reports as the weight version of a server nothing was pushed to
INCOMPLETE_VERSION = "incomplete push"  # a server a push failed on: its weights are part old, part new
LOAD_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_ADAPTER = "/v1/unload_lora_adapter"
PROBE_TEMPERATURES = (1.0, 2.0)  # vLLM allows at most 2; the flatter, the likelier the runner-up is finite
CLEANUP_S = 10.0  # after a push past its deadline: time left to end the servers' open updates before stopping


class ServerError(UserError, RuntimeError):
    """A vLLM server answered with an error, lacks an endpoint, or is started with the wrong flags."""


class NotAVLLMServer(ServerError):
    """An address that answers, but not as a vLLM server does: waiting would not help."""


class Server:
    """One vLLM server's HTTP API; also vLLM's `VLLMWeightSyncClient` interface for it."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: float | None = None,
        read: tuple[str | int, ...] | None = None,
    ) -> Any:
        """The JSON answer, or with `read` the item at that path in it (NotAVLLMServer if it is not there)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        limit = timeout or self.timeout
        try:
            with urllib.request.urlopen(req, timeout=limit) as resp:
                raw, kind = resp.read(), resp.headers.get_content_type()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if path in ("/health", "/v1/models") and 400 <= e.code < 500:  # every vLLM server has both
                raise self.not_vllm(method, path, f"HTTP {e.code} {_snippet(detail.encode())}") from None
            if e.code == 404 and path == LOAD_ADAPTER:
                raise ServerError(
                    f"vLLM server at {self.url} has no {LOAD_ADAPTER}: start it with --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as one API server (`python -m grpo_trainer serve` does when "
                    "rollout.lora_sync asks for adapters)"
                ) from None
            if e.code == 404 and path.split("?")[0] not in ("/v1/completions", "/v1/models", "/health"):
                raise ServerError(
                    f"vLLM server at {self.url} has no {path.split('?')[0]}: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(needed for weight pushes; `python -m grpo_trainer serve` does, docs/vllm.md)"
                ) from None
            if path == "/collective_rpc" and "grpo_reload_weights" in detail:
                raise ServerError(
                    f"vLLM server at {self.url} lacks the weight-sync extension (weight_sync: disk): start it with "
                    f"--worker-extension-cls grpo_trainer.rollout.weight_sync.WorkerWeightSync: {detail}"
                ) from None
            raise ServerError(f"vLLM server {method} {self.url}{path} failed: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(
                reason,
                (
                    ConnectionRefusedError,
                    ConnectionResetError,
                    BrokenPipeError,
                    http.client.RemoteDisconnected,
                    http.client.IncompleteRead,
                ),
            ):
                raise ServerGone(
                    self.url, f"vLLM server at {self.url} went away during {method} {path}: {reason}"
                ) from None
            raise ServerUnreachable(
                f"vLLM server at {self.url} did not answer {method} {path} within {limit:g}s: {reason}"
            ) from None
        if path == "/health":
            return None  # vLLM's is empty; what else a server says there is judged by /v1/models
        if path in (LOAD_ADAPTER, UNLOAD_ADAPTER) and kind == "text/plain":
            return raw.decode(errors="replace")  # vLLM's answer to these: "Success: LoRA adapter ..."
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            raise self.not_vllm(method, path, f"{kind} {_snippet(raw)}") from None
        if read is None:
            return answer
        item: Any = answer
        for key in read:
            try:
                item = item[key]
            except (KeyError, IndexError, TypeError):
                raise self.not_vllm(
                    method, path, f"{_snippet(raw)}, without {''.join(f'[{k!r}]' for k in read)}"
                ) from None
        return item

    def not_vllm(self, method: str, path: str, answer: str) -> NotAVLLMServer:
        return NotAVLLMServer(
            f"rollout.vllm_server: {self.url} is not a vLLM server (or not vLLM 0.32's API): {method} {path} answered "
            f"{answer}. Give the server's root address (e.g. http://127.0.0.1:8000, without /v1) and start it with "
            "`python -m grpo_trainer serve CONFIG`"
        )

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether `GET /health` answers; NotAVLLMServer where something else answers there."""
        try:
            self.request("GET", "/health", timeout=timeout)
            return True
        except NotAVLLMServer:
            raise
        except (ServerUnreachable, ServerError):
            return False

    def wait_until_healthy(self, seconds: float) -> bool:
        """Poll `GET /health` for up to `seconds`; True as soon as it answers."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if self.healthy(timeout=max(0.1, min(5.0, left))):
                return True
            if deadline - time.monotonic() <= 0:
                return False
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def weight_version(self) -> str:
        return str(self.request("GET", "/weight_info", read=("weight_version",)))

    def workers(self) -> int:
        """Workers across the server's data-parallel replicas: its ranks in a transfer group."""
        return int(self.request("GET", "/get_world_size", read=("world_size",)))

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters of ours (lora_sync.ADAPTER_PREFIX) the server holds."""
        return [
            m.get("id", "")
            for m in self.request("GET", "/v1/models", read=("data",))
            if str(m.get("id", "")).startswith(ADAPTER_PREFIX)
        ]

    def model(self) -> str:
        """The model the server serves (also the check that it is a vLLM server at all)."""
        name = self.request("GET", "/v1/models", read=("data", 0, "id"))
        if not isinstance(name, str):
            raise self.not_vllm("GET", "/v1/models", f"a model id {name!r}")
        return name

    # vLLM's VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request(
            "POST", "/finish_weight_update", None if weight_version is None else {"weight_version": weight_version}
        )


def each(servers: list[Server], call, *args) -> list[Any]:
    """`call(server, *args)` on every server at once; the first error is raised as soon as it happens (the
    others are left to finish on their own: one may be blocked on a peer that just died)."""
    if len(servers) == 1:
        return [call(servers[0], *args)]
    pool = ThreadPoolExecutor(max_workers=len(servers))
    try:
        futures = [pool.submit(call, server, *args) for server in servers]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            error = future.exception() if future in done else None
            if error is not None:
                raise error
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=False)


class AllServers:
    """vLLM's `VLLMWeightSyncClient` over every server at once, for one transfer group spanning them all.

    vLLM's trainer-side engines address one server whose workers sit at `rank_offset` 1 (after the trainer);
    server k's workers go after the trainer's and servers 0..k-1's, so its init info gets its own offset."""

    def __init__(self, servers: list[Server], workers: list[int]):
        self.servers = servers
        self.offsets = [1 + sum(workers[:k]) for k in range(len(servers))]
        self.version: str | None = None  # the version the current push finishes with
        self.abandoned = False  # the push ran past its deadline: if it ever gets that far, it must not finish

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        each(
            self.servers,
            lambda server: server.init_weight_transfer_engine(
                {**init_info, "rank_offset": self.offsets[self.servers.index(server)]}
            ),
        )

    def start_weight_update(self) -> None:
        each(self.servers, Server.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        each(self.servers, Server.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.abandoned:
            raise PushFailed("weight push abandoned past its deadline: not finished")
        each(self.servers, Server.finish_weight_update, weight_version or self.version)

    def shutdown_weight_transfer_engine(self) -> None:
        for server in self.servers:
            try:
                server.request("POST", "/shutdown_weight_transfer_engine", timeout=10)
            except (ServerUnreachable, ServerError):
                pass  # gone, or never initialised: nothing to release there


class _Tracked:
    """A weight source as handed to a transfer engine, which can be run to its end after a failed push (so the
    other ranks' ZeRO-3 gathers, collectives, are not left waiting for this one)."""

    def __init__(self, source: MergedWeights):
        self.source = source
        self.live: Iterator[tuple[str, Any]] | None = None

    def metadata(self):
        return self.source.metadata()

    def __iter__(self):
        self.live = iter(self.source)
        return self.live

    def drain(self) -> None:
        for _ in self.live or ():
            pass


class VLLMServerEngine(Reconnects):
    """External vLLM servers, each with its own copy of the weights (pushed after each update), sampling while the
    trainer updates (rollout.max_staleness >= 1); a server restarts from its model folder, without the pushed
    weights (Reconnects). Each rank's requests are its own; the servers' memory is theirs (nothing to free here)."""

    def __init__(
        self,
        sampling: SamplingSettings,
        settings: VLLMServerConfig | None = None,
        *,
        seed: int | None = 0,
        model_name: str | None = None,
        is_main_process: bool = True,
        lora_sync: str = "merged",
        server_dtype: torch.dtype | None = None,
        max_staleness: int = 0,
    ):
        """`settings` is the `rollout.vllm_server` section (defaults: one server on 127.0.0.1:8000); `lora_sync`:
        `adapter` or `auto` to push LoRA adapters (lora_sync.push_adapters decides; `auto` may still fall back);
        `server_dtype`: the servers' weight dtype where it is known to differ from the trainer's (`rollout.vllm.dtype`),
        for the push probe's tolerance; `max_staleness`: rollout.max_staleness, how many adapters before the
        current one stay loaded for requests in flight."""
        from ..config import VLLMServerConfig

        settings = settings or VLLMServerConfig()
        self.settings = settings
        self.servers = [Server(url, settings.timeout) for url in settings.server_urls()]
        self.sampling = sampling  # replace it (dataclasses.replace) to sample differently from the next call on
        self.seed = seed
        self.weight_sync = settings.weight_sync
        self.weights_dir = (
            Path(settings.weights_dir) if settings.weights_dir else None
        )  # None: our own, at the first push
        self._remove_weights_dir: weakref.finalize | None = None
        self.is_main_process = is_main_process
        self.weight_version: Any = None  # the version of the last push (None: nothing pushed yet)
        self._pushes = 0
        self._calls = 0
        self._client: AllServers | None = None
        self._transfer: Any = None  # vLLM's trainer-side transfer engine (nccl / gloo), built at the first push
        self.lora_sync = lora_sync
        self.keep_adapters = max_staleness + 1  # loaded after a push: the current adapter and the K before it
        self.adapters = (
            None
            if lora_sync == "merged"
            else AdapterFolders(Path(settings.weights_dir or "") / "adapters", keep=adapter_slots(max_staleness))
        )
        self._adapter: tuple[Any, str | None] = (None, None)  # (weight version, the adapter name sampled from)
        self.server_dtype = server_dtype
        # The push's data plane runs in a worker of this pool, within the push's deadline (push_checks.py).
        self._push_calls = UserCalls(
            "weight push", workers=1, max_abandoned=1, limit_key="rollout.vllm_server.push_timeout"
        )
        self.push_limit: float | None = None  # the last push's deadline, in seconds
        self.probe_seconds = 0.0  # the last push probe's time (every server, and the trainer's forward)
        self._probe_skipped = False  # said once that ZeRO-3 runs no probe
        self.wait_until_healthy(settings.startup_timeout)
        names = [server.model() for server in self.servers]
        if len(set(names)) > 1:
            raise ServerError(
                "rollout.vllm_server.urls: the servers serve different models: "
                + ", ".join(f"{s.url}: {n}" for s, n in zip(self.servers, names))
            )
        self.model_name = model_name or names[0]
        if is_main_process and self.weight_sync != "none":
            self._release_a_dead_trainers_push()
        for server in self.servers:
            self.check_processed_logprobs(server)

    def wait_until_healthy(self, seconds: float) -> None:
        """Wait until every server answers its health check; ConnectionError naming the first that does not."""
        wait_for_servers(self.servers, seconds)

    def reconnect(self, timeout: float) -> bool:
        """Whether every server answers its health check within `timeout` seconds (NotAVLLMServer, for an address
        where something else now answers, is raised: waiting would not help)."""
        try:
            self.wait_until_healthy(timeout)
            return True
        except ConnectionError:
            return False

    @property
    def base_url(self) -> str:
        return self.servers[0].url

    # ------------------------------------------------------------------ start-up check
    def check_processed_logprobs(self, server: Server) -> None:
        """Refuse a server that reports raw log-probs (see the module docstring).

        The log-prob gap between the two likeliest next tokens is (l1 - l2) / T when log-probs are processed,
        and l1 - l2 whatever T when they are raw: from T = 1 to T = 2 it halves, or stays. (Not read from the
        server's config: `/server_info` exists only in dev mode, which a server that is never pushed to lacks.)
        A gap too small (or a runner-up vLLM reports as -9999, i.e. -inf) to tell says nothing either way."""
        gaps = []
        for temperature in PROBE_TEMPERATURES:
            body = {
                "model": self.model_name,
                "prompt": [list(self.sampling.eos_token_ids[:1])],
                "max_tokens": 1,
                "temperature": temperature,
                "top_p": 1.0,
                "top_k": 0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "logprobs": 2,
                "seed": 0,
            }
            top = server.request("POST", "/v1/completions", body, read=("choices", 0, "logprobs", "top_logprobs", 0))
            best = sorted(top.values(), reverse=True)[:2]
            if len(best) < 2 or best[1] < -1000:
                return
            gaps.append(best[0] - best[1])
        if gaps[0] < 1e-3:
            return
        if gaps[1] / gaps[0] > 0.75:  # processed: 0.5; raw: 1
            raise ServerError(
                f"vLLM server at {server.url} reports raw log-probs (they ignore the temperature): start it with "
                "--logprobs-mode processed_logprobs (`python -m grpo_trainer serve` does)"
            )

    # ------------------------------------------------------------------ sampling
    def _requests(
        self,
        prompt_ids: list[list[int]],
        n: int,
        seeds: list[int] | None,
        max_tokens: int | None,
        call: int,
        first: int,
    ) -> list[tuple[list[int], dict]]:
        """(prompt indices, request body) for prompts first, first + 1, ... of the engine's `call`-th generate call.
        Seeded: one request per prompt, each with its own seed (vLLM would give all prompts of one request the
        same seeds). Unseeded: one request per server."""
        if seeds is None and self.seed is None:
            parts = min(len(self.servers), len(prompt_ids))
            groups = [list(range(len(prompt_ids)))[k::parts] for k in range(parts)]
        else:
            groups = [[i] for i in range(len(prompt_ids))]
        out = []
        for group in groups:
            seed = request_seed(self.seed, call, first + group[0], n, None if seeds is None else seeds[group[0]])
            body = {
                "model": self.sampled_model(),
                "prompt": [list(prompt_ids[i]) for i in group],
                "return_token_ids": True,
                **sampling_fields(self.sampling, n, seed=seed if len(group) == 1 else None, max_tokens=max_tokens),
            }
            out.append((group, body))
        return out

    def sampled_model(self) -> str:
        """The name requests ask for: the current adapter's, or the base model's (merged pushes; nothing pushed)."""
        if self.adapters is None or self.weight_version is None:
            return self.model_name
        if self.adapters.current is not None:
            return self.adapters.current.name
        version, name = self._adapter
        if version != self.weight_version:  # another rank pushed: the first server says what it loaded
            name = newest_adapter(self.servers[0].adapters())
            self._adapter = (self.weight_version, name)
        return name or self.model_name

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[Any] | None = None,
    ) -> Rollout:
        assert episodes is None, "a sampler runs no environment (environments/episodes.py's EpisodeEngine does)"
        self._check_versions()
        call, self._calls = self._calls, self._calls + 1
        step = self.sampling.batch_size or len(prompt_ids)
        rows: dict[int, list[tuple[list[int], list[float], bool]]] = {}
        for start in range(0, len(prompt_ids), step):
            chunk = prompt_ids[start : start + step]
            requests = self._requests(
                chunk, num_generations, None if seeds is None else seeds[start : start + step], max_tokens, call, start
            )
            for (group, _), answer in zip(requests, self._send_all([body for _, body in requests])):
                choices = sorted(answer["choices"], key=lambda c: c["index"])
                if len(choices) != len(group) * num_generations:
                    raise ServerError(
                        f"vLLM server returned {len(choices)} choices for {len(group)} x {num_generations}"
                    )
                for k, i in enumerate(group):  # choices come prompt by prompt, n each
                    rows[start + i] = [self._read(c) for c in choices[k * num_generations : (k + 1) * num_generations]]
        samples = [sample for i in range(len(prompt_ids)) for sample in rows[i]]
        return Rollout(
            completion_ids=[s[0] for s in samples],
            truncated=[s[2] for s in samples],
            sampling_logprobs=[s[1] for s in samples],
        )

    def _read(self, choice: dict) -> tuple[list[int], list[float], bool]:
        ids = list(choice.get("token_ids") or [])
        lps = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        return cut_completion(ids, lps, set(self.sampling.eos_token_ids), choice.get("finish_reason"))

    def _send_all(self, bodies: list[dict]) -> list[dict]:
        """POST every body to /v1/completions, body j to server j mod S, all at once (each server batches
        what it gets). A server that goes away: see `_recover`."""
        answers: list[dict | None] = [None] * len(bodies)
        for _attempt in range(3):
            todo = [j for j, a in enumerate(answers) if a is None]
            if not todo:
                break
            gone: dict[str, ServerGone] = {}
            with ThreadPoolExecutor(max_workers=min(64, len(todo))) as pool:
                futures = {
                    j: pool.submit(self.servers[j % len(self.servers)].request, "POST", "/v1/completions", bodies[j])
                    for j in todo
                }
                for j, future in futures.items():
                    try:
                        answers[j] = future.result()
                    except ServerGone as e:
                        gone[e.url] = e
            if gone:
                self._recover([s for s in self.servers if s.url in gone])
        if any(a is None for a in answers):
            raise ServerUnreachable(f"vLLM server(s) kept dropping requests: {', '.join(s.url for s in self.servers)}")
        return answers  # type: ignore[return-value]

    def _recover(self, servers: list[Server]) -> None:
        """Wait for servers that went away; raise WeightsLost if they came back without our weights."""
        self._await(servers, "")
        self._check_versions(servers)

    def _await(self, servers: list[Server], during: str) -> None:
        """Wait up to reconnect_timeout for each server to answer again, else stop naming it."""
        limit = self.settings.reconnect_timeout
        for server in servers:
            if not server.wait_until_healthy(limit):
                raise ServerUnreachable(
                    f"vLLM server at {server.url} went away{during} and did not come back within "
                    f"{limit:g}s (rollout.vllm_server.reconnect_timeout)"
                )

    def _check_versions(self, servers: list[Server] | None = None) -> None:
        """WeightsLost for servers whose weight version is not the one last pushed (they restarted)."""
        if self.weight_version is None or self.weight_sync == "none":
            return  # nothing pushed: a restarted server holds the same weights as before
        lost = [s for s in servers or self.servers if s.weight_version() != str(self.weight_version)]
        if lost:
            raise WeightsLost([s.url for s in lost], self.weight_version)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Gather | None = None) -> None:
        """Push `model`'s weights (LoRA merged) to every server as `version` (default: a count of pushes).

        Call it on every rank; with `gather` (weight_sync.zero3_gather) every rank iterates the weights piece
        by piece, and the main process sends them. Each push runs within its deadline and is then checked by the
        probe (push_checks.py): either failing raises `PushFailed`."""
        self._pushes += 1
        version = self._pushes if version is None else version
        if self.weight_sync == "none":
            return
        if self.adapters is not None:
            self._sync_adapter(model, version, gather)
            if self.adapters is not None:  # else it fell back to a merged push, which was checked
                self._check_live(model, version, gather, "adapter")
            return
        source = _Tracked(MergedWeights(model, gather))
        if not self.is_main_process:
            if gather is not None:
                for _ in source:  # take part in the gathers
                    pass
            self.weight_version = version
            return
        self.push_limit = self.settings.push_timeout or default_push_timeout(pushed_bytes(source.metadata()))
        try:
            self._push_in_time(lambda gave_up: self._push(source, version, gave_up), version, self.weight_sync)
        except PushFailed:
            raise  # past its deadline: the servers are not gone (waiting for them would outlast it), the push stalled
        except Exception as error:
            gone = [s for s in self.servers if not s.healthy()]
            if not gone and not _lost_connection(error):
                raise
            if gather is not None:
                source.drain()  # the other ranks are in the same gathers
            self._close_transfer()
            self._await(gone, " during a weight push")
            if gather is not None:  # a second pass over ZeRO-3 pieces needs every rank: the caller repeats the push
                raise WeightsLost(
                    [s.url for s in gone] or [s.url for s in self.servers], self.weight_version
                ) from error
            again = _Tracked(MergedWeights(model, gather))
            # The servers (re)join a new transfer group.
            self._push_in_time(lambda gave_up: self._push(again, version, gave_up), version, self.weight_sync)
        self.weight_version = version
        self._check_live(model, version, gather, self.weight_sync)

    def _sync_adapter(self, model: torch.nn.Module, version: Any, gather: Gather | None) -> None:
        """Write the adapter as a new version and load it on every server (main process; the others take part in
        the ZeRO-3 gathers). A first push refused under `lora_sync: auto` turns the run to merged pushes."""
        assert self.adapters is not None, "adapter pushes only under rollout.lora_sync adapter or auto"
        first = self.adapters.count == 0
        adapter = self.adapters.write(model, gather, write=self.is_main_process)
        if not self.is_main_process:
            self.adapters.current = None  # the main process named it: read from the server (`sampled_model`)
            self.weight_version = version
            return
        try:
            self._load_adapter(adapter, version)
        except ServerError as error:
            if not (first and self.lora_sync == "auto"):
                raise
            if gather is not None:  # the other ranks gathered the adapter, not the merged weights
                raise ServerError(
                    f"rollout.lora_sync=auto: {error}; under ZeRO-3 set rollout.lora_sync=merged"
                ) from None
            log_fallback(str(error))
            self.adapters, self._pushes = None, self._pushes - 1
            self.sync_weights(model, version)
            return
        except PushFailed:
            raise
        except Exception as error:
            gone = [s for s in self.servers if not s.healthy()]
            if not gone and not _lost_connection(error):
                raise
            self._await(gone, " during a weight push")
            self._load_adapter(adapter, version)  # the folder is written: loading it again needs no other rank
        self.weight_version = version

    def _load_adapter(self, adapter: Adapter, version: Any) -> None:
        self.push_limit = self.settings.push_timeout or default_push_timeout(adapter_bytes(adapter.path))

        def load(server: Server, gave_up: threading.Event) -> None:
            held = server.adapters()
            if adapter.name not in held:  # held already: a push repeated after another server went away
                server.request(
                    "POST", LOAD_ADAPTER, {"lora_name": adapter.name, "lora_path": str(adapter.path.resolve())}
                )
            for name in stale_adapters(held, adapter, self.keep_adapters):
                server.request("POST", UNLOAD_ADAPTER, {"lora_name": name})
            if gave_up.is_set():  # got past its stall after its deadline: the servers are marked, and stay so
                raise PushFailed(f"adapter push version {version} abandoned past its deadline: not labelled")
            server.request("POST", "/update_weight_version", {"new_version": str(version)})

        def load_everywhere(gave_up: threading.Event) -> None:
            with self._paused():
                each(self.servers, load, gave_up)

        self._push_in_time(load_everywhere, version, "adapter")

    # ------------------------------------------------------------------ a push's deadline and its probe
    def _push_in_time(self, push: Callable[[threading.Event], None], version: Any, method: str) -> None:
        """`push(gave_up)` (a push's data plane, main process) in a worker, within `push_limit` seconds; past it, the push
        is abandoned: the transfer group is dropped (its sockets close, so the servers' workers stop waiting for
        the next bucket), each server's open update is ended and marked "incomplete push", and `PushFailed` names
        the servers, the method and the version. Whatever the push raised in time is raised here, as it is."""
        limit = self.push_limit or default_push_timeout(0)
        gave_up = threading.Event()
        outcome = self._push_calls.run([Call(lambda: push(gave_up), limit, name="weight push")], check=False)[0]
        if outcome.timed_out is not None:
            gave_up.set()
            self._push_calls.run([Call(self._abandon_push, CLEANUP_S, name="weight push clean-up")], check=False)
            raise PushFailed(
                f"weight push version {version} to {', '.join(s.url for s in self.servers)} ({method}) did not "
                f"complete within {limit:g}s (rollout.vllm_server.push_timeout)"
            )
        if outcome.exception is not None:
            raise outcome.exception

    def _abandon_push(self) -> None:
        transfer, self._transfer = self._transfer, None
        if self._client is not None:
            self._client.abandoned = True
        self._client = None
        if transfer is not None:
            transfer.shutdown()  # drops the group: peers blocked in it get an error at once
        self._end_open_updates(self.servers, timeout=CLEANUP_S / 4)
        for server in self.servers:
            try:
                server.request("POST", "/resume", timeout=CLEANUP_S / 4)
            except (ServerUnreachable, ServerError):
                pass

    def _check_live(self, model: torch.nn.Module, version: Any, gather: Gather | None, method: str) -> None:
        """The probe (push_checks.py), main process: every server's log-probs of the fixed probe against the
        trainer's, within the dtype's tolerance, else `PushFailed` (that server's version set to "incomplete push").

        Not under ZeRO-3 (`gather`): the trainer's forward would be a collective of every rank through DeepSpeed's
        hooks, and run that way after a piecewise push it aborted a rank (tests/test_async_vllm.py's ZeRO-3 run,
        SIGABRT); gathering the whole model for it would undo the piecewise push. Said once, in the log."""
        if not self.settings.push_probe or not self.is_main_process:
            return
        if gather is not None:
            if not self._probe_skipped:
                self._probe_skipped = True
                logger.warning(
                    "rollout.vllm_server.push_probe: not run under DeepSpeed ZeRO-3 (the trainer's forward of the "
                    "probe would need the whole model gathered); the pushes keep their deadline and weight versions"
                )
            return
        started = time.perf_counter()
        tokens = probe_tokens(vocab_size(model))
        ours = trainer_logprobs(model, tokens)
        name = self.sampled_model()
        answers = each(
            self.servers,
            lambda server: server.request("POST", "/v1/completions", probe_body(name, tokens), read=("choices", 0)),
        )
        limit = self.settings.push_probe_tolerance or tolerance(_weights_dtype(model), self.server_dtype)
        for server, answer in zip(self.servers, answers):
            try:
                theirs = server_logprobs(answer.get("prompt_logprobs") or [None], tokens)
            except ValueError as e:
                raise server.not_vllm(
                    "POST", "/v1/completions", f"no prompt_logprobs for the push probe: {e}"
                ) from None
            mean, worst = mismatch(theirs, ours)
            if mean > limit:
                try:
                    server.request("POST", "/update_weight_version", {"new_version": INCOMPLETE_VERSION})
                except (ServerUnreachable, ServerError):
                    pass
                raise PushFailed(
                    f"weight push version {version} to {server.url} ({method}): the server does not hold the pushed "
                    f"weights: its log-probs of the push probe differ from the trainer's by {mean:.3g} nats on average "
                    f"(max {worst:.3g}; tolerance {limit:g}, rollout.vllm_server.push_probe_tolerance)"
                )
        self.probe_seconds = time.perf_counter() - started

    def _push(self, source: _Tracked, version: Any, abandoned: threading.Event | None = None) -> None:
        """One push of `source` as `version` (the main process's part). `abandoned`: set when the caller gave up on
        it (past its deadline); a push that gets past its stall afterwards stops before it labels the servers."""
        expected = FRESH_VERSION if self.weight_version is None else str(self.weight_version)
        if self._transfer is not None and any(s.weight_version() != expected for s in self.servers):
            self._close_transfer()  # a server restarted: its workers are not in our transfer group any more
        with self._paused():
            if self.weight_sync == "disk":
                folder = save_weights(source.source.model, self._weights_folder(), gather=source.source.gather).parent
                each(
                    self.servers,
                    lambda server: server.request(
                        "POST",
                        "/collective_rpc",
                        {"method": "grpo_reload_weights", "kwargs": {"weights_path": str(folder.resolve())}},
                    ),
                )
                if abandoned is not None and abandoned.is_set():
                    raise PushFailed(f"weight push version {version} abandoned past its deadline: not labelled")
                each(
                    self.servers,
                    lambda server: server.request("POST", "/update_weight_version", {"new_version": str(version)}),
                )
            else:
                if self._transfer is None:
                    self._open_transfer(source)
                self._transfer.source = source
                assert self._client is not None  # opened with the transfer
                self._client.version = str(version)
                try:
                    self._transfer.send_weights()
                except BaseException:
                    self._end_open_updates(self.servers)
                    raise

    @staticmethod
    def _end_open_updates(servers: list[Server], timeout: float | None = None) -> None:
        """End the weight update a failed push left open on each server, with what it received: vLLM's
        layer-wise reload keeps layers on the meta device until `/finish_weight_update`, and the first request
        after `/resume` would crash the server. What it holds then is part old, part new (a fused layer may
        even be half loaded), so its version says so: sampling from it raises WeightsLost until a full push.
        (An error means there was nothing open, or the server is gone.)"""
        for server in servers:
            for path, body in (
                ("/finish_weight_update", None),
                ("/update_weight_version", {"new_version": INCOMPLETE_VERSION}),
            ):
                try:
                    server.request("POST", path, body, timeout=timeout)
                except (ServerUnreachable, ServerError):
                    pass

    def _release_a_dead_trainers_push(self) -> None:
        """A server left paused by a trainer that died mid-push: end its update, let it sample again."""
        for server in self.servers:
            try:
                paused = server.request("GET", "/is_paused", timeout=10, read=("is_paused",))
            except (ServerUnreachable, ServerError):
                continue  # not a dev-mode server: nothing of ours can be open there
            if paused:
                self._end_open_updates([server])
                server.request("POST", "/resume")

    @contextmanager
    def _paused(self):
        """Requests in flight finish with the old weights, none start until the push is done, and no KV block
        computed with the old weights is reused after it."""
        each(self.servers, lambda server: server.request("POST", "/pause?mode=wait"))
        try:
            yield
            each(self.servers, lambda server: server.request("POST", "/reset_prefix_cache"))
        finally:
            for server in self.servers:
                try:
                    server.request("POST", "/resume")
                except (ServerUnreachable, ServerError):
                    pass  # it went away: it comes back unpaused

    def _open_transfer(self, source: _Tracked) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        workers = each(self.servers, Server.workers)
        self._client = AllServers(self.servers, workers)
        world_size = 1 + sum(workers)
        host = urllib.parse.urlparse(self.servers[0].url).hostname or "127.0.0.1"
        settings = self.settings
        if self.weight_sync == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=settings.transfer_host or address_towards(host),
                master_port=settings.transfer_port or _free_port(),
                world_size=world_size,
                rank=0,
                packed=True,
                packed_buffer_size_bytes=int(settings.transfer_bucket_mb * 2**20),
            )
        else:
            from .gloo_transfer import GlooTrainerInitInfo
            from .vllm_plugin import register

            register()  # the trainer's process may not have loaded vLLM's plugins
            info = GlooTrainerInitInfo(
                master_address=settings.transfer_host or address_towards(host),
                master_port=settings.transfer_port,
                world_size=world_size,
                rank=0,
                bucket_bytes=int(settings.transfer_bucket_mb * 2**20),
                # A collective blocked on either side fails by itself within the push's deadline.
                timeout_s=min(settings.timeout, self.push_limit or settings.timeout),
            )
        try:
            self._transfer = WeightTransferTrainerFactory.trainer_init(info, client=self._client, source=source)
        except ServerError as e:
            if "Invalid weight transfer backend" in str(e) or "not configured" in str(e):
                raise ServerError(
                    f"rollout.vllm_server.weight_sync={self.weight_sync}: the server at {self.base_url} was not started "
                    f'with --weight-transfer-config \'{{"backend": "{self.weight_sync}"}}\' (`python -m grpo_trainer '
                    f"serve` does): {e}"
                ) from None
            raise

    def _close_transfer(self) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.shutdown()
        if self._client is not None:
            self._client.shutdown_weight_transfer_engine()
            self._client = None

    def _weights_folder(self) -> Path:
        """`weights_dir`, or a fresh folder of this engine's own, removed at `close` (or at exit, if never closed)."""
        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix="grpo_trainer_vllm_weights_"))
            self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, self.weights_dir, ignore_errors=True)
        return self.weights_dir

    def close(self) -> None:
        """Leave the transfer group (the servers outlive the trainer and may take another one); remove the weights
        folder of our own (the servers have loaded what it held)."""
        if self._transfer is not None:
            self._close_transfer()
        if self._remove_weights_dir is not None:
            self._remove_weights_dir()
        self._push_calls.close()


def wait_for_servers(servers: list[Server], seconds: float, log=None) -> None:
    """Wait up to `seconds` for every server's health check (a server may still be starting: a refused
    connection is waited out); ConnectionError naming the first that does not answer, NotAVLLMServer at once
    for an address where something else answers. `log(message)` hears of a wait before it starts."""
    for server in servers:
        if log is not None and not server.healthy(timeout=min(5.0, seconds)):
            log(f"waiting up to {seconds:g}s (rollout.vllm_server.startup_timeout) for the vLLM server at {server.url}")
        if not server.wait_until_healthy(seconds):
            raise ServerUnreachable(
                f"rollout.engine=vllm_server: no healthy vLLM server at {server.url} after {seconds:g}s. Start one "
                "first: `python -m grpo_trainer serve CONFIG` (or see docs/vllm.md for the vllm serve command)."
            )


def check_servers(settings: VLLMServerConfig, log=None) -> None:
    """What `VLLMServerEngine` checks first, for preflight (before the trainer loads its model): every server
    answers its health check within startup_timeout and is a vLLM server serving a model."""
    servers = [Server(url, settings.timeout) for url in settings.server_urls()]
    wait_for_servers(servers, settings.startup_timeout, log)
    for server in servers:
        server.model()


def _weights_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's (first floating) weights: what a push sends."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def adapter_bytes(folder: Path) -> int:
    """The bytes of an adapter's folder (what a server loads)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _snippet(raw: bytes, limit: int = 80) -> str:
    """The start of an answer, for a message: one line, quoted."""
    text = " ".join(raw.decode(errors="replace").split())
    return repr(text[:limit] + ("..." if len(text) > limit else "")) if text else "nothing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _lost_connection(error: BaseException) -> bool:
    """A push that failed because a peer's connection dropped (HTTP, or the transfer group's sockets)."""
    text = str(error).lower()
    return isinstance(error, ServerGone) or any(
        word in text for word in ("connection reset", "connection closed", "connection refused", "broken pipe", "peer")
    )
