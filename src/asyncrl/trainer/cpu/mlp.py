"""The SwiGLU MLP's elementwise product in C, forward and backward (bf16 on the CPU).

HF's `down(act(gate(x)) * up(x))` runs silu and a product forward (autograd keeps gate,
up and silu(gate)) and two products and silu's backward in backward, each a pass over
[tokens, intermediate] (1451 x 1536 per layer on the quickstart's batch).
`kernels/swiglu.c` does each direction in one pass with torch's roundings (it says
where a value may differ by one bf16 step) and keeps only gate and up. `use_fused_mlps`
points the model's SwiGLU MLPs at it; inputs it does not cover (fp32, GPU, no C compiler)
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

# The HF MLP classes whose forward is exactly down(act(gate(x)) * up(x)), and the
# activation classes that are silu (torch's, and transformers' own wrapper of F.silu).
FUSED_MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    return kernels.bind("swiglu", {"swiglu_fwd_bf16": [p, p, p, i64, i32],
                                   "swiglu_bwd_bf16": [p, p, p, p, p, i64, i32]})


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)
        _kernels().swiglu_fwd_bf16(gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                                   gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad = grad.to(torch.bfloat16).contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _kernels().swiglu_bwd_bf16(gate.data_ptr(), up.data_ptr(), grad.data_ptr(),
                                   grad_gate.data_ptr(), grad_up.data_ptr(), gate.numel(),
                                   torch.get_num_threads())
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up fused, or None where it does not apply (the caller runs torch's)."""
    if not (cpu_paths().mlp_kernels and gate.dtype == up.dtype == torch.bfloat16
            and gate.device.type == up.device.type == "cpu" and gate.shape == up.shape
            and gate.is_contiguous() and up.is_contiguous() and _kernels() is not None):
        return None
    return _SwiGLU.apply(gate, up)


def _fused_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_proj(x), module.up_proj(x)
    hidden = swiglu(gate, up)
    if hidden is None:
        hidden = module.act_fn(gate) * up
    return module.down_proj(hidden)


def use_fused_mlps(hf_model: nn.Module) -> int:
    """Point each SwiGLU MLP of `hf_model` (a listed class with SiLU) at the fused product;
    returns how many. Idempotent."""
    count = 0
    for module in hf_model.modules():
        if (type(module).__name__ not in FUSED_MLP_CLASSES
                or type(getattr(module, "act_fn", None)).__name__ not in SILU_CLASSES):
            continue
        if not getattr(module, "_asyncrl_fused", False):
            module.forward = functools.partial(_fused_forward, module)
            module._asyncrl_fused = True
        count += 1
    return count
