"""RMSNorm with its own forward and backward in C, for bf16 training on the CPU.

HF's RMSNorm runs as ~10 elementwise ops forward (casts to fp32 and back, pow, mean, rsqrt,
two products) and autograd's ~15 backward, each a pass over the whole activation: at two
threads 4.3 ms per norm forward and backward on the quickstart's [1451, 576], 0.27 s over
a pass through SmolLM2's 61 norms. `kernels/rms_norm.c` does each row in one or two
passes from cache, with HF's roundings (`rms_norm.c` says which). `use_fused_norms` points
the model's RMSNorm modules at it; inputs it does not cover (fp32, GPU, no C compiler)
take HF's own forward.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import nn

from asyncrl import kernels
from asyncrl.trainer.cpu.options import cpu_paths

# The HF norm classes whose forward is exactly Llama's (weight * normed, no offset).
FUSED_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                                "MistralRMSNorm"})


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return kernels.bind("rms_norm", {"rms_norm_fwd_bf16": [p, p, i32, i32, f32, p, p, i32],
                                     "rms_norm_bwd_bf16": [p, p, p, p, i32, i32, p, p, i32]})


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32)
        _kernels().rms_norm_fwd_bf16(rows.data_ptr(), weight.data_ptr(), *rows.shape, eps,
                                     out.data_ptr(), rstd.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight, rstd = ctx.saved_tensors
        grad = grad.reshape(rows.shape).to(torch.bfloat16).contiguous()
        threads = torch.get_num_threads()
        grad_x = torch.empty_like(rows)
        parts = torch.zeros(threads, rows.shape[1], dtype=torch.float32)
        _kernels().rms_norm_bwd_bf16(rows.data_ptr(), weight.data_ptr(), grad.data_ptr(),
                                     rstd.data_ptr(), *rows.shape, grad_x.data_ptr(),
                                     parts.data_ptr(), threads)
        grad_w = parts.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.view(ctx.shape), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The fused norm of `x`, or None where it does not apply (the caller runs HF's)."""
    if not (cpu_paths().norm_kernels and x.dtype == weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and _kernels() is not None):
        return None
    return _RMSNorm.apply(x, weight, eps)


def _fused_forward(module: nn.Module, hf_forward, hidden_states: torch.Tensor) -> torch.Tensor:
    out = rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return hf_forward(hidden_states) if out is None else out


def use_fused_norms(hf_model: nn.Module) -> int:
    """Point each RMSNorm of `hf_model` that computes Llama's formula at the fused kernel;
    returns how many. Idempotent."""
    count = 0
    for module in hf_model.modules():
        if type(module).__name__ not in FUSED_NORM_CLASSES:
            continue
        if not getattr(module, "_asyncrl_fused", False):
            module.forward = functools.partial(_fused_forward, module, module.forward)
            module._asyncrl_fused = True
        count += 1
    return count
