"""Weight sync, third mode: CUDA IPC between a trainer and a server on the same GPU.

    body = exporter.export(state)      # trainer: weights into one GPU buffer, its handle
    layout, handle = parse_update(body)
    buffer = importer.open(handle, device)   # server: the trainer's buffer, mapped
    engine.load_weights(layout.unpack(0, buffer), version); wait_for_copies(device)

No disk and no NCCL (which refuses two ranks on one GPU): the trainer lays its weights end
to end in one GPU buffer (transport.BucketLayout, one bucket; vLLM's packed layout) and
shares that buffer's allocation through CUDA IPC (torch's `reduce_tensor`: a
cudaIpcMemHandle and the buffer's place in it). The handle travels as JSON in the body of
the server's update route (`IpcHandle`; vLLM's route takes it pickled, inference/client/vllm.py).
The server opens it (`rebuild_cuda_tensor`, on its own device index), copies every tensor
into its spare weights, waits for the copies and answers; only then does the trainer write
the buffer again (the publish waits for every server).

The buffer is allocated and exported once and rewritten in place by every publish; the
server keeps the mapping of the handle it opened last (`IpcImporter`), as torch pairs one
export with one import. An export carries a CUDA event recorded when it was made, which
orders nothing written later: the trainer synchronises its stream before handing a buffer
over instead.

A CPU has no CUDA IPC; `actor.weight_update_mode=ipc` is a config error there. The CUDA
calls are `share` and `open_shared` alone: the tests run everything else (the JSON form,
packing, the server's route and copy) with CPU tensors, a registry standing in for them.
"""

from __future__ import annotations

import base64
import inspect
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from asyncrl.weights.transport import BucketLayout

logger = logging.getLogger(__name__)
ONE_BUCKET = 1 << 62  # bucket size that keeps every tensor in one bucket


class IpcUnavailable(RuntimeError):
    """CUDA IPC cannot join these two processes (a CPU engine, another GPU)."""


@dataclass(frozen=True)
class IpcHandle:
    """One GPU buffer (1-D uint8) shared by its process: torch's `rebuild_cuda_tensor`
    arguments for it, and the physical GPU it lives on, in a JSON-safe form."""

    gpu_uuid: str  # the GPU's UUID: device indices differ between processes
    device: int  # the exporter's device index (the importer rebuilds on its own)
    nbytes: int  # the buffer's length
    tensor_offset: int  # its first element's offset in its storage
    storage_handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset in that allocation
    ref_counter_handle: bytes  # torch's cross-process reference count of the export
    ref_counter_offset: int
    event_handle: bytes | None  # the event recorded at export (see the module doc)
    event_sync_required: bool

    @classmethod
    def from_rebuild_args(cls, args: tuple, gpu_uuid: str) -> IpcHandle:
        """From the arguments `reduce_tensor` gives for a 1-D uint8 tensor."""
        a = dict(zip(_REBUILD_PARAMS, args))
        if a["dtype"] != torch.uint8 or len(a["tensor_size"]) != 1 or \
                tuple(a["tensor_stride"]) != (1,):
            raise ValueError(f"an IPC buffer is a 1-D uint8 tensor, got {a['dtype']} of "
                             f"size {tuple(a['tensor_size'])}, stride {tuple(a['tensor_stride'])}")
        return cls(gpu_uuid=gpu_uuid, device=int(a["storage_device"]),
                   nbytes=int(a["tensor_size"][0]), tensor_offset=int(a["tensor_offset"]),
                   storage_handle=a["storage_handle"],
                   storage_size_bytes=int(a["storage_size_bytes"]),
                   storage_offset_bytes=int(a["storage_offset_bytes"]),
                   ref_counter_handle=a["ref_counter_handle"],
                   ref_counter_offset=int(a["ref_counter_offset"]),
                   event_handle=a["event_handle"],
                   event_sync_required=bool(a["event_sync_required"]))

    def rebuild_args(self, device: int | None = None) -> tuple:
        """`rebuild_cuda_tensor`'s arguments, in its order, on `device` (default: the
        exporter's index)."""
        a = {"tensor_cls": torch.Tensor, "tensor_size": torch.Size([self.nbytes]),
             "tensor_stride": (1,), "tensor_offset": self.tensor_offset,
             "storage_cls": torch.storage.TypedStorage, "dtype": torch.uint8,
             "storage_device": self.device if device is None else device,
             "storage_handle": self.storage_handle,
             "storage_size_bytes": self.storage_size_bytes,
             "storage_offset_bytes": self.storage_offset_bytes, "requires_grad": False,
             "ref_counter_handle": self.ref_counter_handle,
             "ref_counter_offset": self.ref_counter_offset, "event_handle": self.event_handle,
             "event_sync_required": self.event_sync_required}
        return tuple(a[name] for name in _REBUILD_PARAMS)

    @property
    def key(self) -> tuple[bytes, int]:
        """What identifies the shared storage (torch's own cache key)."""
        return self.storage_handle, self.storage_offset_bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        return out

    @classmethod
    def from_json(cls, body: Any) -> IpcHandle:
        """ValueError naming the field that is missing or of the wrong type."""
        if not isinstance(body, dict):
            raise ValueError("ipc_handle must be an object")
        unknown = sorted(set(body) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"ipc_handle has unknown fields {unknown}")
        values: dict[str, Any] = {}
        for name, kind in _JSON_KINDS.items():
            value = body.get(name)
            if kind == "bytes" or (kind == "bytes?" and value is not None):
                try:
                    values[name] = base64.b64decode(value, validate=True)
                except (TypeError, ValueError):
                    raise ValueError(f"ipc_handle.{name} must be base64 text") from None
            elif kind == "bytes?":
                values[name] = None
            elif kind is int:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"ipc_handle.{name} must be a non-negative integer, "
                                     f"got {value!r}")
                values[name] = value
            elif not isinstance(value, kind):
                raise ValueError(f"ipc_handle.{name} must be a {kind.__name__}, got {value!r}")
            else:
                values[name] = value
        return cls(**values)


_JSON_KINDS: dict[str, Any] = {
    "gpu_uuid": str, "device": int, "nbytes": int, "tensor_offset": int,
    "storage_handle": "bytes", "storage_size_bytes": int, "storage_offset_bytes": int,
    "ref_counter_handle": "bytes", "ref_counter_offset": int, "event_handle": "bytes?",
    "event_sync_required": bool}


def _rebuild_params() -> tuple[str, ...]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return tuple(inspect.signature(rebuild_cuda_tensor).parameters)


_REBUILD_PARAMS = _rebuild_params()


# ---- the two CUDA calls ------------------------------------------------------------------


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> IpcHandle:
    """Export the GPU buffer `buffer` (1-D uint8) to other processes."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda":
        raise IpcUnavailable(f"CUDA IPC shares GPU memory; this buffer is on {buffer.device}")
    _, args = reduce_tensor(buffer)
    return IpcHandle.from_rebuild_args(args, gpu_uuid(buffer.device))


def open_shared(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """Map the buffer of `handle` into this process, on `device` (which must be its GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if device.type != "cuda":
        raise IpcUnavailable(f"this engine runs on {device}: CUDA IPC needs the server on "
                             "the trainer's GPU; use actor.weight_update_mode=disk")
    index = device.index if device.index is not None else torch.cuda.current_device()
    mine = gpu_uuid(torch.device("cuda", index))
    if mine != handle.gpu_uuid:
        raise IpcUnavailable(f"the trainer's weights are on GPU {handle.gpu_uuid}, this "
                             f"server on GPU {mine}: ipc needs both on one GPU "
                             "(allocation_mode '<backend>:d1|fsdp:d1')")
    return rebuild_cuda_tensor(*handle.rebuild_args(index))


def wait_for_copies(device: torch.device) -> None:
    """Return once the copies queued on `device` have run (then its buffer may be rewritten)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- both ends ---------------------------------------------------------------------------


class IpcExporter:
    """The trainer's end: the weights end to end in one buffer, exported once."""

    def __init__(self, share: Callable[[torch.Tensor], IpcHandle] = share) -> None:
        self._share = share
        self._buffer: torch.Tensor | None = None
        self._handle: IpcHandle | None = None

    def export(self, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Pack `state` (name -> tensor, all on one device) into the shared buffer; the body
        of a server's IPC update: the layout's fields and `ipc_handle`."""
        if not state:
            raise ValueError("no tensors to export")
        tensors = [t.detach() for t in state.values()]
        layout = BucketLayout.plan(((n, t.dtype, t.shape) for n, t in state.items()), ONE_BUCKET)
        size, device = layout.bucket_sizes()[0], tensors[0].device
        if self._buffer is None or self._buffer.numel() < size or self._buffer.device != device:
            self._buffer = self._handle = None  # freed before the new one is made
            self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
            self._handle = self._share(self._buffer)
        layout.pack(0, tensors, self._buffer[:size])
        wait_for_copies(device)  # the export's event predates these writes
        return {**layout.to_body(), "ipc_handle": self._handle.to_json()}

    def close(self) -> None:
        self._buffer = self._handle = None


class IpcImporter:
    """The server's end: the mapping of the last handle opened, kept while it is sent again."""

    def __init__(self, open: Callable[[IpcHandle, torch.device], torch.Tensor] = open_shared
                 ) -> None:
        self._open = open
        self._key: tuple[bytes, int] | None = None
        self._buffer: torch.Tensor | None = None

    def open(self, handle: IpcHandle, device: torch.device) -> torch.Tensor:
        """The buffer of `handle`, mapped once per export (a new handle replaces the old)."""
        if self._key != handle.key:
            self._key = self._buffer = None  # the old mapping goes first
            self._buffer = self._open(handle, device)
            self._key = handle.key
        return self._buffer

    def close(self) -> None:
        self._key = self._buffer = None


def parse_update(body: Any) -> tuple[BucketLayout, IpcHandle]:
    """The layout and handle of an IPC update body; ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    layout = BucketLayout.from_body(body)
    if len(layout.buckets) != 1:
        raise ValueError(f"an IPC update is one buffer: buckets must be [{len(layout.names)}], "
                         f"got {list(layout.buckets)}")
    handle = IpcHandle.from_json(body.get("ipc_handle"))
    end = layout.bucket_sizes()[0]
    if end > handle.nbytes:
        raise ValueError(f"the layout needs {end} bytes but the shared buffer holds "
                         f"{handle.nbytes}")
    return layout, handle


class IpcPublisher:
    """`WeightPublisher.publish` by CUDA IPC: the trainer (inline, or the training service's
    rank 0) exports its weights, every server copies them and serves them as version N."""

    def __init__(self, engine: Any, *, dtype: str = "bfloat16",
                 run: Callable[[Coroutine], Any]) -> None:
        self.engine = engine  # the inference client (update_weights_from_ipc)
        self.dtype = dtype
        self._run = run

    def publish(self, actor: Any, version: int) -> dict[str, float]:
        """Export `actor`'s weights (`actor.ipc_weights`) and have every server load them;
        timings. WeightUpdateError names a server that failed (it keeps its old weights)."""
        t0 = time.monotonic()
        body = actor.ipc_weights(self.dtype)
        t1 = time.monotonic()
        self._run(self.engine.update_weights_from_ipc(body, version))
        stats = {"perf/weights_export_s": t1 - t0, "perf/weights_load_s": time.monotonic() - t1}
        logger.debug("published weights v%d by CUDA IPC: %s", version, stats)
        return stats

    def close(self) -> None:
        """Nothing to release here (the trainer owns its buffer)."""
