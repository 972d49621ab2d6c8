"""One safetensors file, written in place and read without a copy.

The format: 8 bytes (little-endian) giving the header's size, the JSON header (per tensor
its dtype, shape and [begin, end) within the data; "__metadata__"), then the data.

Weight publishing writes the same tensors, of the same shapes, every step. `write` puts
them into the pages of an existing file whose header is the same, instead of a new file:
fresh pages cost a fault each, and on a VM whose host takes freed memory back (balloon
free-page reporting) even the page cache of a new file is slow to fill (a 270 MB file took
0.07 s into reused pages and up to 0.7 s into fresh ones, here). `mapped` gives a file's
tensors as views of its mapping, for a reader that copies them into its own buffers (the
local engine's weight load) without a 270 MB intermediate copy.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


class SafetensorsFormatError(ValueError):
    """A file that is not a whole safetensors file (truncated, a bad header...)."""


def header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The size prefix and JSON header for `tensors`, laid out in their order."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name here")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
          metadata: Mapping[str, str] | None = None) -> bool:
    """Write `tensors` as the safetensors file `path`. If `path` already holds a file with
    the same header (names, dtypes, shapes, order), its data is overwritten in place and
    True is returned; else the file is written anew (False). Whoever may still read the old
    file must be done with it: a reader that mapped it sees the new bytes."""
    head = header(tensors, metadata)
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    in_place = _same_header(path, head, len(head) + data)
    with open(path, "r+b" if in_place else "wb") as f:
        if in_place:
            f.seek(len(head))
        else:
            f.write(head)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return in_place


def _same_header(path: str | os.PathLike, head: bytes, size: int) -> bool:
    try:
        if os.path.getsize(path) != size:
            return False
        with open(path, "rb") as f:
            return f.read(len(head)) == head
    except OSError:
        return False


@contextlib.contextmanager
def mapped(path: str | os.PathLike) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of the safetensors file `path` as views of its private mapping, valid
    inside the block only: copy what you keep. SafetensorsFormatError if the file is not
    whole. Dtypes this module does not name raise the same error (read such a file with
    safetensors itself)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise SafetensorsFormatError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise SafetensorsFormatError(f"{path}: the header ({n} bytes) runs past the file's end")
        try:
            entries = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: the header is not JSON ({e})") from e
        if not isinstance(entries, dict):
            raise SafetensorsFormatError(f"{path}: the header is not a JSON object")
        # ACCESS_COPY: writable views (torch.frombuffer wants them), never written to.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, entry in entries.items():
            if name == "__metadata__":
                continue
            tensors[name] = _view(path, mm, 8 + n, size, name, entry)
        yield tensors
    finally:
        tensors.clear()
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view kept beyond the block holds it open
                mm.close()


def _view(path: str | os.PathLike, mm: mmap.mmap | None, start: int, size: int, name: str,
          entry: dict) -> torch.Tensor:
    try:
        dtype = TORCH_DTYPES.get(entry["dtype"])
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has a malformed entry "
                                     f"{entry!r} ({e})") from e
    if dtype is None:
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, "
                                     f"not one of {sorted(TORCH_DTYPES)}")
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0 or start + end > size:
        raise SafetensorsFormatError(
            f"{path}: tensor {name!r} ({entry['dtype']} {shape}) has data offsets "
            f"[{begin}, {end}) that do not fit it or the file ({size} bytes)")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=start + begin).view(shape)
