"""A CPU weight-transfer backend for vLLM ("gloo"): vLLM's own RL protocol, gloo instead of NCCL underneath.

vLLM 0.32 pushes weights into a running server through a registry of transfer backends
(`vllm/distributed/weight_transfer/factory.py`): the trainer calls
`/init_weight_transfer_engine`, then for every push `/start_weight_update`, `/update_weights` (while
it sends the tensors), `/finish_weight_update` with a weight version. Built in is `nccl` (GPU to
GPU); nothing runs on a CPU. This module is the same protocol over a gloo process group, registered
under the name "gloo" on both sides (`vllm_plugin.register`, loaded by vLLM from this package's
`vllm.general_plugins` entry point). Start a server with
`--weight-transfer-config '{"backend": "gloo"}'` (`python -m grpo_trainer serve` does) and the trainer
code is the one `nccl` uses: only the data plane differs. It also works between GPUs (tensors go
through host memory), as a fallback where NCCL cannot connect.

Mirrors vLLM's `nccl_engine.py` piece for piece:
- Group: one trainer process (rank 0, the sender) and every worker of every server (rank_offset + the
  worker's rank), rendezvous over a `TCPStore` the trainer opens. A plain `ProcessGroupGloo`, not the
  default process group: the trainer may already be inside Accelerate's, and a server's workers inside
  vLLM's.
- Data: the tensors declared in `/update_weights` (names, dtypes, shapes), packed into buckets of at
  most `bucket_bytes` (a larger tensor travels alone) that both sides cut the same way from that
  declaration (`plan_buckets`). The trainer holds one bucket at a time, copying each tensor in as the
  source yields it (so a ZeRO-3 piece can be released right after); a worker receives a bucket into a
  fresh buffer and hands its tensors to `model.load_weights`.
- Loading: vLLM's layer-wise reload (`start_weight_update` / `finish_weight_update`), which re-runs the
  kernel-format processing (on CPU the packed GEMM weights). Tied embeddings: the loader skips a tied
  `lm_head`, which on CPU keeps a packed copy of the old embeddings; the worker records tied parameters
  at the start of an update and re-ties them at its end (`weight_sync.retie`), as the disk path does.
- Failure: the group has a timeout (the push's deadline, `rollout.vllm_server.push_timeout`, push_checks.py); a
  peer that dies closes its sockets and the other side's broadcast fails at once. A worker whose update breaks off finishes the reload with what it has (no layer is
  left on the meta device) and waits for the next full push.
"""

from __future__ import annotations

import datetime
import gc
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .weight_sync import ParamMeta, address_towards, retie, tied_parameter_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 600.0
ALIGN = 64  # each tensor starts on a multiple of this in a bucket, so its bytes view as any dtype
STORE_PREFIX = "grpo_trainer/gloo_transfer"


# ----------------------------------------------------------------------------- what both sides agree on


@dataclass(frozen=True)
class Bucket:
    """Tensors first..last-1 of the declaration, at byte `offsets` (relative to the bucket), `nbytes` in all."""

    first: int
    last: int
    offsets: tuple[int, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[Bucket]:
    """Cut tensors of the given byte sizes, in order, into buckets of at most `bucket_bytes` each (a tensor
    larger than that alone in its own). The one rule both the trainer and every worker apply to the same
    declaration, so they agree on every boundary without sending it."""
    buckets: list[Bucket] = []
    first, used = 0, 0
    offsets: list[int] = []
    for i, size in enumerate(sizes):
        start = _aligned(used)
        if offsets and start + size > bucket_bytes:
            buckets.append(Bucket(first, i, tuple(offsets), used))
            first, offsets, start = i, [], 0
        offsets.append(start)
        used = start + size
    if offsets:
        buckets.append(Bucket(first, len(sizes), tuple(offsets), used))
    return buckets


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gloo weight transfer: unknown dtype {name!r}")
    return dtype


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: torch.distributed.Store | None = None,
) -> torch.distributed.ProcessGroup:
    """A gloo group of `world_size` over a TCPStore at master_address:master_port (rank 0 hosts it: pass
    `store`); blocks until every rank joined or `timeout_s` passed."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(master_address, master_port, world_size, False, timeout=timeout)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    own = master_address if rank == 0 else address_towards(master_address)
    options._devices = [ProcessGroupGloo.create_device(hostname=own)]
    return ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), rank, world_size, options)


# ----------------------------------------------------------------------------- the server's side


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a server's workers need to join the trainer's group (sent in `/init_weight_transfer_engine`)."""

    master_address: str
    master_port: int
    rank_offset: int  # this server's first worker's rank in the group (after the trainer and earlier servers)
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One push's declaration (sent in `/update_weights`): every tensor's checkpoint name, dtype and shape."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"gloo weight transfer: {len(self.names)} names, {len(self.dtype_names)} dtypes, {len(self.shapes)} shapes"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Runs inside each vLLM worker (created by vLLM when the server has `{"backend": "gloo"}`)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self._tied: list | None = None  # tied parameter groups recorded by start_weight_update

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a second init (the trainer rebuilt its group, e.g. after another server restarted)
        parallel = self.parallel_config
        # The worker's rank across the data-parallel replicas of this server, as vLLM's NCCL backend counts it.
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._tied = tied_parameter_groups(self.model)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator afterwards, which raises on a CPU-only process.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()  # leave no layer on the meta device; the trainer pushes everything again
            raise
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: not initialised (call /init_weight_transfer_engine first)")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [_dtype(d) for d in update_info.dtype_names]
        sizes = [_nbytes(dtype, shape) for dtype, shape in zip(dtypes, update_info.shapes)]
        with disable_mtp_completeness_check():
            for bucket in plan_buckets(sizes, self.bucket_bytes):
                # A fresh buffer per bucket: the layer-wise loader may hold views of it until a layer is complete.
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
                self.group.broadcast(buffer, 0).wait()
                tensors = []
                for k, i in enumerate(range(bucket.first, bucket.last)):
                    raw = buffer[bucket.offsets[k] : bucket.offsets[k] + sizes[i]]
                    tensors.append((update_info.names[i], raw.view(dtypes[i]).view(update_info.shapes[i])))
                self.model.load_weights(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self._tied:
            retie(self._tied)
        self._tied = None

    def shutdown(self) -> None:
        _drop_group(self)


def _drop_group(owner) -> None:
    """Let go of `owner.group` so that its sockets close: peers blocked in it get an error at once. (Measured
    with torch 2.13: `abort()` and `shutdown()` leave the sockets open, and a peer waiting for the next bucket
    waits until this process exits; destroying the group object closes them.)"""
    owner.group = None
    gc.collect()


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------- the trainer's side


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info, as vLLM's `NCCLTrainerInitInfo`: the group's rendezvous and wire params.

    `world_size` counts the trainer (1) and every worker of every server. `rank` is the trainer process's
    own rank; rank 0 sends, the others only iterate the source (for ZeRO-3 gathers)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's end: opens the group, and for each push drives the server(s) through `client` while it
    broadcasts the buckets. Built with `WeightTransferTrainerFactory.trainer_init` like vLLM's NCCL one."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source=None,
        is_sender: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = None
        self._store = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source=None):
        from torch.distributed import TCPStore

        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine  # not in the group: only iterates the source in send_weights
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        engine._store = store = TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
        )
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=store.port,
            rank_offset=1,
            world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
        )
        # The workers join inside /init_weight_transfer_engine, which returns once they have: join beside it,
        # in a thread of our own, so that a server refusing the init is an error now, not after the timeout.
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = open_group(
                    init_info.master_address, store.port, 0, init_info.world_size, init_info.timeout_s, store=store
                )
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                joined["error"] = e

        joiner = threading.Thread(target=join, name="gloo-transfer-join", daemon=True)
        joiner.start()
        client.init_weight_transfer_engine(asdict(worker_info))
        joiner.join(init_info.timeout_s)
        if "group" not in joined:
            raise RuntimeError(
                f"gloo weight transfer: the trainer could not join the group: {joined.get('error', 'timeout')}"
            )
        engine.group = joined["group"]
        return engine

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # stay in step with the sender's gathers
                pass
            return
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answered = pool.submit(self.client.update_weights, asdict(update_info))

            # If the servers fail the update (e.g. one died), stop broadcasting to them at once.
            def abort_if_failed(answer: Future) -> None:
                if answer.exception() is not None:
                    self._abort()

            answered.add_done_callback(abort_if_failed)
            try:
                self._broadcast(source, meta)
            except BaseException:
                refused = answered.exception() if answered.done() else None
                if refused is not None:
                    raise refused from None  # the servers' reason (e.g. one went away) says more
                raise
            answered.result()
        except BaseException:
            self._abort()  # the group is unusable; peers blocked in it get an error instead of waiting
            raise
        finally:
            pool.shutdown(wait=False)  # never join a thread stuck on a dead peer
        self.client.finish_weight_update()

    def _broadcast(self, source, meta: list[ParamMeta]) -> None:
        """Copy each yielded tensor into the current bucket at once (so a gathered piece can be released), and
        broadcast the bucket when it is full; a tensor larger than a bucket goes out on its own."""
        sizes = [_nbytes(m.dtype, m.shape) for m in meta]
        buckets = plan_buckets(sizes, self.bucket_bytes)
        largest = max((b.nbytes for b in buckets), default=0)
        staging = torch.empty(min(largest, self.bucket_bytes) or 1, dtype=torch.uint8)
        pairs = _checked(source, meta)
        for bucket in buckets:
            buffer = staging if bucket.nbytes <= staging.numel() else torch.empty(bucket.nbytes, dtype=torch.uint8)
            for k, i in enumerate(range(bucket.first, bucket.last)):
                _name, tensor = next(pairs)
                start = bucket.offsets[k]
                buffer[start : start + sizes[i]].view(tensor.dtype).copy_(tensor.reshape(-1))
            group = self.group
            if group is None:
                raise RuntimeError("gloo weight transfer: the servers abandoned the update")
            try:
                group.broadcast(buffer[: bucket.nbytes], 0).wait()
            finally:
                del group  # not kept alive by a traceback: dropping the group must close its sockets
        for _ in pairs:  # run the source to its end: _checked raises if it yields more than it declared
            pass

    def _abort(self) -> None:
        _drop_group(self)

    def shutdown(self) -> None:
        _drop_group(self)
        self._store = None


def _checked(source, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against what the workers were told to expect (as vLLM's NCCL engine
    does): a mismatch would split the stream differently on the two sides."""
    count = 0
    for name, tensor in source:
        if count >= len(meta):
            raise ValueError(f"weight source yielded more tensors than it declared ({len(meta)}); first extra {name!r}")
        want = meta[count]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(
                f"weight source declared {want.name} {want.dtype} {tuple(want.shape)} at {count} but "
                f"yielded {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"weight source yielded {count} tensors but declared {len(meta)}")
