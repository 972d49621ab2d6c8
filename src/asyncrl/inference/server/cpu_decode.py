"""What the CPU forward of kernels/decode.c needs from Python: its ctypes bindings, the
packed weight layout its matmuls read, and memory on 2 MB pages.

Without AVX512-BF16 only the per-op kernels and the sampler exist (`has_gemm` False) and
the model keeps oneDNN's prepacked weights (`can_pack`).
"""

from __future__ import annotations

import functools
import math
import mmap
import sys
from dataclasses import dataclass

import torch

from asyncrl import kernels


class DecodeKernels:
    """ctypes bindings of kernels/decode.c: a whole bf16 CPU decode step, and its parts."""

    def __init__(self, lib):
        import ctypes

        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        # The matmul kernels need AVX512-BF16; on other CPUs only the per-op kernels exist.
        self.has_gemm = hasattr(lib, "forward_rows_bf16")
        if self.has_gemm:
            self.gemm = lib.gemm_bf16
            self.gemm.argtypes = [p, i64, i32, i32, p, i32, p, p, i64, i32]
            self.gemm_silu = lib.gemm_silu_bf16
            self.gemm_silu.argtypes = [p, i64, i32, i32, p, i32, p, p, i64, i32]
            self.forward_rows = lib.forward_rows_bf16
            self.forward_rows.argtypes = [p, i32, p, p, i32, p, p, p, i64, p, p, i32, p, i32, p,
                                          p, i32, i32, i32, i32, i32, i32, f32, f32, p, p, i64,
                                          p, i32]
            for fn in (self.gemm, self.gemm_silu, self.forward_rows):
                fn.restype = None
            # AMX tiles under the same matmuls where the CPU and Linux allow them
            self.has_amx = bool(lib.gemm_has_amx())
            self.use_amx = lib.gemm_use_amx
            self.use_amx.argtypes, self.use_amx.restype = [i32], None
        else:
            self.has_amx = False
        self.add_rms_norm = lib.add_rms_norm_bf16
        self.add_rms_norm.argtypes = [p, p, p, p, i32, i32, f32, p]
        self.silu_mul = lib.silu_mul_bf16
        self.silu_mul.argtypes = [p, p, i32, i32]
        self.rope_attention = lib.rope_attention_bf16
        self.rope_attention.argtypes = [p, i64, p, p, p, p, p, p, p, p, i32, i32, i32, i32, i32,
                                        f32, f32, p, i32]
        self.sample_rows = lib.sample_rows_bf16
        self.sample_rows.argtypes = [p, i32, i32, p, p, p, p, p, i32]
        for fn in (self.add_rms_norm, self.silu_mul, self.rope_attention, self.sample_rows):
            fn.restype = None

    @staticmethod
    def load() -> DecodeKernels | None:
        """The compiled kernels, or None where they cannot be built (the torch path is used).

        One bindings object per process: the sampler asks for it every step."""
        return _decode_kernels()


@functools.cache
def _decode_kernels() -> DecodeKernels | None:
    lib = kernels.load("decode")
    return DecodeKernels(lib) if lib is not None else None


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights can be prepacked for oneDNN (bf16 on CPU)."""
    return (dtype == torch.bfloat16 and device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    """libc's madvise, or None (not Linux, or no libc found)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on CPU, backed by 2 MB pages where the kernel gives them (madvise).

    The decode step streams every weight and the whole KV cache once per step; with 4 KB
    pages that is a TLB miss every 4 KB, and 2 MB pages made a step 5-7% faster here.
    Falls back to plain torch.empty for small tensors or when madvise is refused.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    rounded = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    raw = torch.empty(rounded + _HUGE_PAGE, dtype=torch.uint8)
    return _aligned_view(raw, nbytes, rounded, shape, dtype, madvise)


def _aligned_view(raw: torch.Tensor, nbytes: int, advised: int, shape: tuple[int, ...],
                  dtype: torch.dtype, madvise) -> torch.Tensor:
    """The 2 MB-aligned `shape` view of `raw` (one spare page long), its first `advised`
    bytes advised onto huge pages before the first touch; a refusal is harmless."""
    start = -(-raw.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    if madvise is not None:
        madvise(start, advised, 14)  # MADV_HUGEPAGE
    offset = start - raw.data_ptr()
    return raw[offset:offset + nbytes].view(dtype).view(shape)  # a view keeps `raw` alive


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on CPU from fresh anonymous memory, advised onto 2 MB pages.

    The kernel hands out zeroed pages on first touch, so nothing is written here: a KV
    cache of a GB costs no start-up time and only its used part becomes resident. Zeroing
    it up front instead made the kernel compact memory for every 2 MB page at once (~3 s
    per 400 MB here, on the critical path of every run's start).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + _HUGE_PAGE), dtype=torch.uint8)
    return _aligned_view(raw, nbytes, nbytes - nbytes % _HUGE_PAGE, shape, dtype, _madvise())


@dataclass
class PackedMatrix:
    """A bf16 weight [n, k] packed for kernels/decode.c: [n / 16, k / 2, 16, 2].

    With `silu`, the rows are gate | up ([2 i, k]) with their blocks of 16 interleaved, and
    the product is silu(gate) * up ([., i]) in one pass.
    """

    data: torch.Tensor
    n: int
    k: int
    silu: bool = False

    @classmethod
    def pack(cls, w: torch.Tensor, *, silu: bool = False,
             out: torch.Tensor | None = None) -> PackedMatrix:
        """Pack w [n, k]; into `out` (n * k elements, e.g. a slice of an arena) if given."""
        n, k = w.shape
        if silu:  # g0..g15 u0..u15 g16..g31 u16..u31 ...
            w = torch.stack(w.view(2, n // 32, 16, k).unbind(0), 1).reshape(n, k)
        blocks = w.view(n // 16, 16, k // 2, 2).transpose(1, 2)
        data = blocks.contiguous() if out is None else out.view(blocks.shape).copy_(blocks)
        return cls(data, n, k, silu)

    @staticmethod
    def pack_bias(b: torch.Tensor | None, *, silu: bool = False) -> torch.Tensor | None:
        if b is None or not silu:
            return b
        return torch.stack(b.view(2, -1, 16).unbind(0), 1).reshape(-1).contiguous()
