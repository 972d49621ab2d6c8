"""Passes over the trainer's gradients in C (`kernels/grad_ops.c`), with torch
fallbacks: a transposing copy (`trainer/cpu/linear.py`'s weight gradients, and `t_matmul`, the
log-prob head's), fp32 += bf16 (`trainer/cpu/precision.py`'s sums over micro-batches), both
torch's numbers exactly, and the global gradient norm (to fp32 precision; tests)."""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncrl import kernels
from asyncrl.trainer.cpu.options import cpu_paths

WIDEN_CHUNK = 1 << 16  # elements of the torch fallback's widened chunk: 256 KiB of fp32
TRANSPOSED_ROWS = 8192  # rows of x^T per chunk in `t_matmul` (the head's: 8192 x tokens)


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib = kernels.bind("grad_ops", {"transpose_bf16": [p, i32, i32, i64, p, i32],
                                    "add_bf16_to_f32": [p, p, i64, i32],
                                    "sum_squares_f32": [p, p, i32, i32]})
    if lib is not None:
        lib.sum_squares_f32.restype = ctypes.c_double
    return lib


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return (cpu_paths().grad_kernels and all(t.device.type == "cpu" for t in tensors)
            and _kernels() is not None)


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous() for a 2-D x."""
    rows, cols = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and _on_cpu(x)):
        return x.t().contiguous()
    out = torch.empty((cols, rows), dtype=x.dtype)
    _kernels().transpose_bf16(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(),
                              torch.get_num_threads())
    return out


def t_matmul(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x.t() @ y for x [K, M] and y [K, N], into `out` [M, N] if given.

    oneDNN reads a transposed first operand at about a third of its speed on the log-prob
    head's weight gradient (template [tokens, vocab]^T @ hidden: 132 vs 38 ms at one
    thread); x^T is copied in chunks of `TRANSPOSED_ROWS` rows (~30 ms for the whole
    template), each multiplied contiguous into its rows of the output.
    """
    if not (x.dtype == y.dtype == torch.bfloat16 and x.dim() == y.dim() == 2
            and x.stride(1) == 1 and _on_cpu(x, y)):
        return torch.mm(x.t(), y, out=out)
    (k, m), n = x.shape, y.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype)
    y = y.contiguous()
    chunk = torch.empty((min(m, TRANSPOSED_ROWS), k), dtype=x.dtype)
    for start in range(0, m, TRANSPOSED_ROWS):
        rows = chunk[:min(TRANSPOSED_ROWS, m - start)]
        _kernels().transpose_bf16(x[:, start:].data_ptr(), k, rows.shape[0], x.stride(0),
                                  rows.data_ptr(), torch.get_num_threads())
        torch.mm(rows, y, out=out[start:start + rows.shape[0]])
    return out


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm of all `tensors` together, as torch.nn.utils.get_total_norm gives it
    (fp32, 0-dim), in one parallel pass (squares summed in float per 4096, then double), or
    None where that does not apply (other than plain contiguous fp32 CPU tensors).

    torch's norm ran the quickstart model's 272 gradients one at a time, ~40 ms at one
    thread or two alike; this one splits all the elements between the threads.
    """
    if not (tensors and all(type(t) is torch.Tensor and t.dtype == torch.float32
                            and t.is_contiguous() for t in tensors) and _on_cpu(*tensors)):
        return None
    ptrs = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    sizes = (ctypes.c_int64 * len(tensors))(*(t.numel() for t in tensors))
    squares = _kernels().sum_squares_f32(ptrs, sizes, len(tensors), torch.get_num_threads())
    return torch.tensor(squares, dtype=torch.float64).sqrt().float()


def add_widened(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part where part is narrower (fp32 += bf16).

    One `add_` across dtypes goes through TensorIterator's casting loop, ~5x slower than the
    kernel (the tied embedding's 28M: 60 -> 12 ms at one thread); the torch fallback widens
    a cache-sized chunk at a time (20 ms).
    """
    if (part.dtype == total.dtype or part.shape != total.shape
            or not (total.is_contiguous() and part.is_contiguous())):
        total.add_(part)
        return
    if total.dtype == torch.float32 and part.dtype == torch.bfloat16 and _on_cpu(total, part):
        _kernels().add_bf16_to_f32(total.data_ptr(), part.data_ptr(), total.numel(),
                                   torch.get_num_threads())
        return
    flat, narrow = total.view(-1), part.view(-1)
    for start in range(0, flat.numel(), WIDEN_CHUNK):
        flat[start:start + WIDEN_CHUNK].add_(narrow[start:start + WIDEN_CHUNK].to(flat.dtype))
