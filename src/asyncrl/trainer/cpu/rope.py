"""Rotary position embedding in C, forward and backward (bf16 on the CPU).

HF's `q * cos + rotate_half(q) * sin` is six passes over q (and k) forward and about eight
backward (two products, the slices' zero-filled gradients, a negation, a concatenation and
their sums); on the quickstart's batch these took ~0.14 s of a 2.4 s step at one thread.
`kernels/rope.c` does each direction in one pass with the same bf16 roundings, bit
for bit (tests compare with HF's function and its autograd). `use_fused_rope` points the
model's modeling module at it; inputs it does not cover (fp32, GPU, cos/sin that need a
gradient, no C compiler) take HF's own function, so other models of that module in the
process get the same numbers either way.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from asyncrl import kernels
from asyncrl.trainer.cpu.options import cpu_paths

# HF modeling modules whose `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` is the
# rotate-half form above.
FUSED_MODULES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    args = [p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i32]
    return kernels.bind("rope", {"rope_fwd_bf16": args, "rope_bwd_bf16": args})


def _run(fn: Callable, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)  # x's strides (HF's q and k are transposed views)
    B, H, N, D = x.shape
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), B, H, N, D,
       x.stride(0), x.stride(1), x.stride(2), torch.get_num_threads())
    return out


class _Rope(torch.autograd.Function):
    """x [B, H, N, D] (contiguous along D), cos and sin [B, N, D] contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _run(_kernels().rope_fwd_bf16, x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _run(_kernels().rope_bwd_bf16, grad, cos, sin), None, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [B, H, N, D] rotated by cos and sin [B, N, D], or None where the kernel does not
    apply (the caller runs HF's)."""
    if not (cpu_paths().rope_kernels and x.dim() == 4
            and x.dtype == cos.dtype == sin.dtype == torch.bfloat16
            and x.device.type == cos.device.type == sin.device.type == "cpu"
            and cos.shape == sin.shape == (x.shape[0], x.shape[2], x.shape[3])
            and x.shape[3] % 2 == 0 and x.stride(-1) == 1
            and not (cos.requires_grad or sin.requires_grad) and _kernels() is not None):
        return None
    return _Rope.apply(x, cos.contiguous(), sin.contiguous())


def _fused(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, unsqueeze_dim: int = 1):
        if unsqueeze_dim == 1:
            q_out, k_out = rotate(q, cos, sin), rotate(k, cos, sin)
            if q_out is not None and k_out is not None:
                return q_out, k_out
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.asyncrl_original = original
    return apply_rotary_pos_emb


def use_fused_rope(hf_model: nn.Module) -> bool:
    """Point the modeling module of `hf_model`'s attention (one of FUSED_MODULES) at the
    fused rotation; whether it applies. Idempotent."""
    for module in hf_model.modules():
        if type(module).__name__.endswith("Attention"):
            source = inspect.getmodule(type(module))
            break
    else:
        return False
    name = getattr(source, "__name__", "").rsplit(".", 1)[-1].removeprefix("modeling_")
    original = getattr(source, "apply_rotary_pos_emb", None)
    if name not in FUSED_MODULES or original is None:
        return False
    if not hasattr(original, "asyncrl_original"):
        source.apply_rotary_pos_emb = _fused(original)
    return True
