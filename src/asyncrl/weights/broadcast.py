"""Weight sync, second mode: trainer rank 0 broadcasts the weights to every server.

    sender = WeightSender(rank)                              # on every trainer rank
    sender.connect(address, port, world_size, timeout)       # rank 0 hosts the group
    stats = sender.send(actor, bucket_bytes=..., on_layout=start_receiving)  # every rank

`send` is a collective of the trainer ranks: each gathers the full weights in lockstep
(`hf_state_dict`, as saving does); then rank 0 hands the bucket layout to `on_layout` (the
servers start receiving) and broadcasts the buckets (transport.py) on a side thread,
bounded by the timeout. Rank 0 can be any process, e.g. a training-service rank, as long
as someone starts the servers' receive with the layout it returns.

`BroadcastPublisher` has `WeightPublisher`'s interface and drives both ends from one
process: group (re)made when needed, pause, receive while rank 0 broadcasts, version N,
resume. Any failure is an error within the timeout and leaves each server with its old
weights and version (ours; vLLM's and SGLang's are left paused, see their clients), and
the next publish makes a new group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import torch

from asyncrl.api.errors import InferenceError
from asyncrl.weights import transport
from asyncrl.weights.transport import BucketLayout

logger = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl", "vllm")  # the group: torch's (SGLang's way), or vLLM's NCCL one


class BroadcastError(InferenceError):
    """The trainer's side of a broadcast failed: the group never formed, a peer died or hung."""


class FullWeights(Protocol):
    """What the sender gathers from: `FSDPTrainEngine`, one per trainer rank."""

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A collective: the full weights under HF names on rank 0, {} on the others."""
        ...


class WeightClient(Protocol):
    """The inference client's broadcast calls (`HTTPInferenceClient`)."""

    addresses: list[str]
    weight_group: list[str]
    weight_group_name: str | None

    async def reachable_servers(self) -> list[str]: ...

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        servers: list[str], bucket_bytes: int,
                                        backend: str = "gloo",
                                        group_name: str = transport.GROUP_NAME) -> None: ...

    async def update_weights_from_distributed(self, layout: dict[str, Any], version: int, *,
                                              group_name: str = transport.GROUP_NAME) -> None: ...

    async def destroy_weights_update_group(self, group_name: str = transport.GROUP_NAME) -> None:
        ...


class _TorchGroup:
    """The group as SGLang makes it: gloo on CPU buffers, or NCCL from this rank's GPU."""

    def __init__(self, backend: str, address: str, port: int, world_size: int, timeout: float,
                 group_name: str):
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self.group = transport.join_group(backend=backend, master_address=address,
                                          master_port=port, rank=0, world_size=world_size,
                                          group_name=group_name, timeout=timeout)

    def send(self, layout: BucketLayout, tensors: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], timeout: float) -> None:
        start = transport.broadcast
        if self.device is not None:
            def start(group, bucket: torch.Tensor, timeout: float) -> Callable[[], None]:
                return transport.broadcast(group, bucket.to(self.device), timeout)
        transport.send_buckets(self.group, layout, tensors, buffers, timeout, start=start)

    def close(self) -> None:
        # Its connections close when the last reference goes (then servers waiting in the
        # group fail at once): so none is kept here, nor in a failed send's traceback.
        group, self.group = self.group, None
        if group is not None:
            transport.leave_group(group)


class _VLLMGroup:
    """vLLM's weight-transfer group: its TCP-store rendezvous and NCCL communicator (GPU).

    NCCL calls have no timeout of their own: the side thread's deadline bounds them.
    """

    def __init__(self, address: str, port: int, world_size: int, timeout: float):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = trainer_init({"master_address": address, "master_port": port,
                                  "world_size": world_size})

    def send(self, layout: BucketLayout, tensors: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor], timeout: float) -> None:
        def start(group, bucket: torch.Tensor, timeout: float) -> Callable[[], None]:
            stream = torch.cuda.current_stream()
            self.comm.broadcast(bucket.to(self.device), src=0, stream=stream)
            return stream.synchronize

        transport.send_buckets(None, layout, tensors, buffers, timeout, start=start)

    def close(self) -> None:
        self.comm.destroy()


class WeightSender:
    """The trainer's side of the broadcast: one per trainer rank; rank 0 owns the group."""

    def __init__(self, rank: int = 0, *, backend: str = "gloo",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.rank, self.backend, self.dtype = rank, backend, dtype
        self.timeout = 300.0
        self._group: _TorchGroup | _VLLMGroup | None = None
        self._layout: BucketLayout | None = None
        self._tensors: list[torch.Tensor] | None = None  # gathered, not yet sent
        self._buffers: list[torch.Tensor] = []  # kept: no fresh memory to fault in per send

    @property
    def connected(self) -> bool:
        return self._group is not None

    def free_port(self, host: str) -> int:
        """A port for the group's rendezvous, free on this (rank 0's) host."""
        return free_port(host)

    def connect(self, master_address: str, master_port: int, world_size: int,
                timeout: float, group_name: str = transport.GROUP_NAME) -> None:
        """Rank 0: host the group and return once its `world_size - 1` servers have joined
        (BroadcastError after `timeout` s); `timeout` also bounds every later broadcast.
        Other ranks: nothing to do."""
        self.timeout = timeout
        if self.rank != 0:
            return
        self.close()
        self.adopt(self.open_group(master_address, master_port, world_size, timeout, group_name))

    def open_group(self, master_address: str, master_port: int, world_size: int,
                   timeout: float, group_name: str = transport.GROUP_NAME
                   ) -> _TorchGroup | _VLLMGroup:
        """`connect`'s rendezvous alone: the group, not yet this sender's (see `adopt`)."""
        self.timeout = timeout
        try:
            if self.backend == "vllm":
                return _VLLMGroup(master_address, master_port, world_size, timeout)
            return _TorchGroup(self.backend, master_address, master_port, world_size, timeout,
                               group_name)
        except (RuntimeError, ValueError) as e:  # DistStoreError: a server never came
            raise BroadcastError(f"weight-update group at {master_address}:{master_port}: not "
                                 f"all {world_size - 1} servers joined within {timeout}s: "
                                 f"{e}") from e

    def adopt(self, group: _TorchGroup | _VLLMGroup) -> None:
        """Send through `group` from now on (leaving the one before)."""
        self.close()
        self._group = group

    def gather(self, actor: FullWeights, bucket_bytes: int) -> BucketLayout | None:
        """Every rank, in lockstep: gather the full weights; rank 0 gets their bucket layout."""
        state = actor.hf_state_dict(self.dtype)
        if self.rank != 0:
            return None
        layout = BucketLayout.plan(((n, t.dtype, t.shape) for n, t in state.items()), bucket_bytes)
        if layout != self._layout:
            self._layout, self._buffers = layout, []
        self._tensors = list(state.values())
        return layout

    def broadcast(self) -> dict[str, float]:
        """Rank 0: broadcast what `gather` got, bucket by bucket, within the timeout.

        On failure (a server died or hung, the timeout ran out) the group is left, so
        servers still waiting in it fail at once, and BroadcastError says what happened.
        """
        if self.rank != 0:
            return {}
        if self._group is None or self._tensors is None or self._layout is None:
            raise BroadcastError("broadcast needs connect() and gather() first")
        layout, tensors, self._tensors = self._layout, self._tensors, None
        sizes = layout.bucket_sizes()
        need = layout.buffer_sizes()  # two: the next bucket is packed while one is on the wire
        if len(self._buffers) != len(need) or any(
                b.numel() < n for b, n in zip(self._buffers, need)):
            self._buffers = []
            self._buffers = [torch.empty(n, dtype=torch.uint8) for n in need]
        group, failure = self._group, []

        def run() -> None:
            try:
                group.send(layout, tensors, self._buffers, self.timeout)
            except Exception as e:  # handed to the caller's thread below, without the
                failure.append(e.with_traceback(None))  # frames that hold the group

        thread = threading.Thread(target=run, name="asyncrl-weight-broadcast", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive() or failure:
            self.close()
            what = (f"did not finish within {self.timeout}s" if not failure
                    else f"failed: {failure[0]}")
            raise BroadcastError(f"broadcasting {len(sizes)} buckets of weights {what}") from (
                failure[0] if failure else None)
        return {"weights/buckets": float(len(sizes)), "weights/bytes": float(sum(sizes))}

    def send(self, actor: FullWeights, *, bucket_bytes: int,
             on_layout: Callable[[BucketLayout], None] | None = None) -> dict[str, float]:
        """Every rank: `gather`, then on rank 0 `on_layout(layout)` and `broadcast`."""
        t0 = time.monotonic()
        layout = self.gather(actor, bucket_bytes)
        t1 = time.monotonic()
        if layout is None:
            return {"perf/weights_gather_s": t1 - t0}
        if on_layout is not None:
            on_layout(layout)
        stats = self.broadcast()
        return stats | {"perf/weights_gather_s": t1 - t0,
                        "perf/weights_broadcast_s": time.monotonic() - t1}

    def close(self) -> None:
        """Leave the group (in the background: that may wait on a stuck peer)."""
        group, self._group = self._group, None
        if group is not None:
            threading.Thread(target=group.close, name="asyncrl-weight-group-close",
                             daemon=True).start()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastPublisher:
    """`WeightPublisher.publish` by broadcast: this process drives the servers (through
    their client) and trainer rank 0's sender; other trainer ranks call `sender.send`."""

    def __init__(self, engine: WeightClient, sender: WeightSender | None = None, *,
                 dtype: str = "bfloat16", bucket_mb: int = 256, timeout: float = 300.0,
                 backend: str = "gloo", master_address: str = "127.0.0.1",
                 run: Callable[[Coroutine], Any] = asyncio.run) -> None:
        self.engine = engine
        self.sender = sender or WeightSender(0, backend=backend, dtype=getattr(torch, dtype))
        self.bucket_bytes = bucket_mb << 20
        self.timeout = timeout
        self.master_address = master_address
        self._run = run  # how to run the client's coroutines (e.g. on the rollout loop)
        self._attempt = 0  # connect() calls so far
        self.group_name = transport.GROUP_NAME
        self._lock = threading.Lock()

    def publish(self, actor: FullWeights, version: int) -> dict[str, float]:
        """Broadcast the weights and serve them as `version` on every server; timings.

        WeightUpdateError (from the client) or BroadcastError names what failed.
        """
        t0 = time.monotonic()
        stats: dict[str, float] = {}
        if not self._group_current():
            self.connect()
            stats["perf/weights_connect_s"] = time.monotonic() - t0
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncrl-weight-recv")
        receiving: list[concurrent.futures.Future] = []

        def start(layout: BucketLayout) -> None:
            receiving.append(pool.submit(self._run, self.engine.update_weights_from_distributed(
                layout.to_body(), version, group_name=self.group_name)))

        try:
            stats |= self.sender.send(actor, bucket_bytes=self.bucket_bytes, on_layout=start)
        except BroadcastError as e:
            self._fail(receiving, e)
        finally:
            pool.shutdown(wait=False)
        try:
            receiving[0].result()  # bounded: every step of the client has its timeout
        except InferenceError:
            self.sender.close()  # the servers that failed left the group: make a new one
            raise
        stats["perf/weights_load_s"] = time.monotonic() - t0 - stats.get(
            "perf/weights_connect_s", 0.0) - stats["perf/weights_gather_s"]
        logger.debug("published weights v%d by broadcast: %s", version, stats)
        return stats

    def connect(self) -> None:
        """(Re)make the group: every server the client can reach joins, rank 0 hosts it."""
        self.sender.close()
        servers = self._run(self.engine.reachable_servers())
        port = self.sender.free_port(self.master_address)  # on the host of rank 0
        with self._lock:
            self._attempt += 1
            attempt, hosted = self._attempt, []
        # A new name each time: torch keeps a group's name until its (background) destroy.
        self.group_name = f"{transport.GROUP_NAME}_{port}_{attempt}"

        def host() -> None:  # rank 0 joins while the client has the servers join
            try:
                group = self.sender.open_group(self.master_address, port, 1 + len(servers),
                                               self.timeout, self.group_name)
            except BroadcastError as e:
                hosted.append(e)
                return
            with self._lock:  # a rendezvous that ends after its publish gave up is dropped
                if attempt == self._attempt:
                    self.sender.adopt(group)
                else:
                    group.close()
            hosted.append(None)

        hosting = threading.Thread(target=host, name="asyncrl-weight-group", daemon=True)
        hosting.start()
        try:
            self._run(self.engine.init_weights_update_group(
                self.master_address, port, servers=servers, bucket_bytes=self.bucket_bytes,
                backend="gloo" if self.sender.backend == "gloo" else "nccl",
                group_name=self.group_name))
        except Exception:
            with self._lock:
                self._attempt += 1  # a server could not join: the rendezvous cannot end well
            raise
        hosting.join(self.timeout)
        if not hosted or hosted[0] is not None:
            raise hosted[0] if hosted else BroadcastError(
                f"weight-update group: hosting it did not end within {self.timeout}s")

    def close(self) -> None:
        """Leave the group (the servers' side goes when they notice, or at the next join)."""
        self.sender.close()

    def _group_current(self) -> bool:
        """Whether the group exists and holds every server (none is out of it, or coming back)."""
        return (self.sender.connected and self.engine.weight_group_name == self.group_name
                and self.engine.weight_group == self.engine.addresses)

    def _fail(self, receiving: list[concurrent.futures.Future], error: BroadcastError) -> None:
        """The trainer's side failed: the servers' side fails at once (the group is gone)."""
        if not receiving:
            raise error
        try:
            receiving[0].result()
        except InferenceError as e:  # names the servers; the trainer's side is the cause
            e.add_note(f"trainer side: {error}")
            raise e from error
        raise error
