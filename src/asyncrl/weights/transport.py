"""The broadcast transport of weights, both ends: wire format, process group, send, receive.

A weight update by broadcast sends the policy's HF tensors in buckets. A bucket is the bytes
of consecutive tensors laid end to end (C order), broadcast from group rank 0 as one uint8
tensor: SGLang's "flattened_bucket" and vLLM's packed format. A bucket closes once it holds
more than `bucket_bytes` (vLLM's rule: its receiver derives the cuts from the sizes, so ours
must fall where its do); a tensor larger than that is a bucket of its own.

The receiver learns the layout (names, dtypes, shapes, byte offsets, tensors per bucket)
from the HTTP request that starts the receive, in SGLang's /update_weights_from_distributed
body (`BucketLayout.to_body`).

The group holds the trainer's rank 0 (group rank 0) and one rank per server. It is built
the way SGLang builds its weight-update group (a TCP rendezvous, a store prefixed with the
group name, a torch process group beside the default one, which the trainer ranks keep for
FSDP), so our trainer can join SGLang servers and SGLang-style trainers can join ours.
Every collective runs under a timeout: a peer that died fails it at once (its connection
closes), one that hangs fails it when the timeout runs out.
"""

from __future__ import annotations

import datetime
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

GROUP_NAME = "weight_update_group"  # SGLang's default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a weight update travels: its bucket and its byte offset there."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # keys of DTYPES
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # byte offset of each tensor in its bucket
    buckets: tuple[int, ...]  # tensors in each bucket, in order

    @classmethod
    def plan(cls, tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
             bucket_bytes: int) -> BucketLayout:
        """Tensors (name, dtype, shape) in order, cut into buckets of about `bucket_bytes`."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        names, dtypes, shapes, offsets, buckets = [], [], [], [], []
        filled = count = 0
        for name, dtype, shape in tensors:
            dtype_name = str(dtype).removeprefix("torch.")
            if dtype_name not in DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be sent ({sorted(DTYPES)})")
            names.append(name)
            dtypes.append(dtype_name)
            shapes.append(tuple(int(s) for s in shape))
            offsets.append(filled)
            filled += math.prod(shape) * dtype.itemsize
            count += 1
            if filled > bucket_bytes:
                buckets.append(count)
                filled = count = 0
        if count:
            buckets.append(count)
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), tuple(buckets))

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> BucketLayout:
        """The layout of an /update_weights_from_distributed body; ValueError names the field.

        Without `buckets`, SGLang's meaning: one bucket with every tensor for
        load_format "flattened_bucket", else one broadcast per tensor.
        """
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ValueError("names must be a non-empty list of strings")
        n = len(names)
        if not (isinstance(dtypes, list) and len(dtypes) == n):
            raise ValueError(f"dtypes must be a list of {n} dtype names, one per name")
        dtypes = [str(d).removeprefix("torch.") for d in dtypes]
        unknown = sorted({d for d in dtypes if d not in DTYPES})
        if unknown:
            raise ValueError(f"dtypes {unknown} are not supported ({sorted(DTYPES)})")
        if not (isinstance(shapes, list) and len(shapes) == n and all(
                isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in shapes)):
            raise ValueError(f"shapes must be a list of {n} lists of non-negative integers")
        buckets = body.get("buckets")
        if buckets is None:
            buckets = [n] if body.get("load_format") == "flattened_bucket" else [1] * n
        if not (isinstance(buckets, list) and all(_is_int(b) and b >= 1 for b in buckets)
                and sum(buckets) == n):
            raise ValueError(f"buckets must be a list of positive tensor counts summing to {n}")
        sizes = [math.prod(s) * DTYPES[d].itemsize for s, d in zip(shapes, dtypes)]
        offsets = body.get("offsets")
        if offsets is None:  # laid end to end
            offsets, first = [], 0
            for count in buckets:
                offsets += [sum(sizes[first:first + k]) for k in range(count)]
                first += count
        if not (isinstance(offsets, list) and len(offsets) == n and all(
                _is_int(o) and o >= 0 for o in offsets)):
            raise ValueError(f"offsets must be a list of {n} non-negative byte offsets")
        first = 0
        for count in buckets:  # tensors of a bucket in order and not overlapping
            for i in range(first + 1, first + count):
                if offsets[i] < offsets[i - 1] + sizes[i - 1]:
                    raise ValueError(f"offsets: {names[i]} at byte {offsets[i]} overlaps "
                                     f"{names[i - 1]} ({sizes[i - 1]} bytes at {offsets[i - 1]})")
            first += count
        return cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), tuple(offsets),
                   tuple(buckets))

    def to_body(self) -> dict[str, Any]:
        """The layout as the fields of SGLang's /update_weights_from_distributed body."""
        return {"names": list(self.names), "dtypes": list(self.dtypes),
                "shapes": [list(s) for s in self.shapes], "offsets": list(self.offsets),
                "buckets": list(self.buckets), "load_format": "flattened_bucket"}

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * DTYPES[self.dtypes[i]].itemsize

    def indices(self, bucket: int) -> range:
        """The tensor indices of bucket `bucket`."""
        first = sum(self.buckets[:bucket])
        return range(first, first + self.buckets[bucket])

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket."""
        return [max(self.offsets[i] + self.nbytes(i) for i in self.indices(b))
                for b in range(len(self.buckets))]

    def buffer_sizes(self) -> list[int]:
        """Bytes of the (up to) two buffers that buckets take turns in: buffer j holds
        buckets j, j + 2, ... (send_buckets, receive_buckets)."""
        sizes = self.bucket_sizes()
        return [max(sizes[j::2]) for j in range(min(2, len(sizes)))]

    def unpack(self, bucket: int, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of bucket `bucket` received into `data`: views where aligned."""
        for i in self.indices(bucket):
            dtype = DTYPES[self.dtypes[i]]
            raw = data[self.offsets[i]:self.offsets[i] + self.nbytes(i)]
            if self.offsets[i] % dtype.itemsize:  # a byte view must start on an element
                raw = raw.clone()
            yield self.names[i], raw.view(dtype).view(self.shapes[i])

    def pack(self, bucket: int, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Lay bucket `bucket`'s tensors (all of the layout's, in order) into `out`."""
        for i in self.indices(bucket):
            t = tensors[i]
            if t.dtype != DTYPES[self.dtypes[i]] or tuple(t.shape) != self.shapes[i]:
                raise ValueError(f"{self.names[i]}: {t.dtype} {tuple(t.shape)} does not match "
                                 f"the layout's {self.dtypes[i]} {self.shapes[i]}")
            out[self.offsets[i]:self.offsets[i] + self.nbytes(i)].copy_(
                t.contiguous().view(-1).view(torch.uint8))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def join_group(*, backend: str, master_address: str, master_port: int, rank: int,
               world_size: int, group_name: str = GROUP_NAME,
               timeout: float) -> dist.ProcessGroup:
    """Create (rank 0) or join the weight-update group; returns once all ranks are in.

    SGLang's `init_custom_process_group`: torch's TCP rendezvous, a store prefixed with the
    group name, then the process group through the helper that `init_process_group` uses
    (a private torch function; its options argument was renamed in torch 2.6).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    td = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                              world_size, timeout=td))
    store.set_timeout(td)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                         PrefixStore(group_name, store), group_name=group_name,
                                         timeout=td, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: dist.ProcessGroup) -> None:
    """Destroy a group (its connections close, so peers waiting in it fail at once)."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError):  # already gone, or broken by a dead peer
        pass


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout: float) -> Callable[[], None]:
    """Start broadcasting `tensor` from group rank 0; returns the wait (raises on failure)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    opts.timeout = datetime.timedelta(seconds=timeout)
    work = group.broadcast([tensor], opts)
    return work.wait


def send_buckets(group: dist.ProcessGroup, layout: BucketLayout,
                 tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 timeout: float, *,
                 start: Callable[[dist.ProcessGroup, torch.Tensor, float], Callable[[], None]]
                 = broadcast) -> None:
    """Broadcast every bucket of `layout` (rank 0), packing the next one while one is in flight.

    `buffers`: uint8 tensors of `layout.buffer_sizes()` (two let the packing of a bucket
    overlap the sending of the one before), or one of the largest bucket's size.
    """
    sizes = layout.bucket_sizes()
    pending: list[Callable[[], None] | None] = [None] * len(buffers)
    for b, size in enumerate(sizes):
        slot = b % len(buffers)
        if pending[slot] is not None:
            pending[slot]()  # the buffer is free again once its bucket is out
        out = buffers[slot][:size]
        layout.pack(b, tensors, out)
        pending[slot] = start(group, out, timeout)
    for wait in pending:
        if wait is not None:
            wait()


def receive_buckets(group: dist.ProcessGroup, layout: BucketLayout,
                    buffers: Sequence[torch.Tensor],
                    timeout: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every bucket of `layout` as it arrives from rank 0 of `group`.

    `buffers`: as for `send_buckets`. With two the next bucket is received while the caller
    consumes this one's tensors (views into a buffer: copy them before asking for the next
    bucket's).
    """
    sizes = layout.bucket_sizes()
    waits = [broadcast(group, buffers[0][:sizes[0]], timeout)]
    for b in range(len(sizes)):
        waits[b]()
        if b + 1 < len(sizes):
            if len(buffers) == 1:
                yield from layout.unpack(b, buffers[0])
                waits.append(broadcast(group, buffers[0][:sizes[b + 1]], timeout))
                continue
            waits.append(broadcast(group, buffers[(b + 1) % 2][:sizes[b + 1]], timeout))
        yield from layout.unpack(b, buffers[b % len(buffers)])
