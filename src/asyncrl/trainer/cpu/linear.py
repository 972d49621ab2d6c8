"""Linear layers whose weight gradient multiplies contiguous operands (bf16 on the CPU).

For y = x W^T over rows x [M, in], autograd computes the weight's gradient as
grad^T @ x with grad [M, out] read transposed. oneDNN runs that layout at about half the
speed of two row-major operands (SmolLM2's projections at the quickstart's ~1.5k rows, one
thread: 540-640 vs 1000-1300 GFLOP/s); copying grad^T into a contiguous [out, M] first and
multiplying that costs less than the difference (down_proj's 5.2 -> 2.8 ms, gate/up's
4.6 -> 3.8 ms with torch's copy; the copy in C, `grad_ops.transposed`, is ~2x faster
again). The forward and the input's gradient are autograd's own ops.

`use_contiguous_weight_grads` points the model's `nn.Linear` modules at it; other inputs
(fp32, GPU) take `nn.Linear`'s forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from asyncrl.trainer.cpu.grad_ops import transposed
from asyncrl.trainer.cpu.options import cpu_paths


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = transposed(rows) @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if (cpu_paths().contiguous_linear and torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.bfloat16):
        return _Linear.apply(x, weight, module.bias)
    return F.linear(x, weight, module.bias)


def use_contiguous_weight_grads(model: nn.Module) -> int:
    """Point each plain `nn.Linear` in `model` at `_Linear`; returns how many. Idempotent."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if not getattr(module, "_asyncrl_linear", False):
            module.forward = functools.partial(_forward, module)
            module._asyncrl_linear = True
        count += 1
    return count
