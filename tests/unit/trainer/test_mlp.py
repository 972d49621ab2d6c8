"""The SwiGLU product in C (trainer/cpu/mlp.py) against HF's MLP."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from asyncrl.trainer.cpu import mlp
from asyncrl.trainer.cpu.options import use_cpu_paths

needs_kernels = pytest.mark.skipif(mlp._kernels() is None, reason="no C compiler")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same-sign values; 0 where equal)."""
    ia, ib = (x.view(torch.int16).to(torch.int32) for x in (a, b))
    return (ia - ib).abs()


def run(module, x, fused):
    with use_cpu_paths(mlp_kernels=fused):
        x = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        y = module(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        return y, x.grad, module.gate_proj.weight.grad, module.up_proj.weight.grad


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_swiglu_is_hfs_mlp_to_one_bf16_step(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=2, hidden_act="silu")
    module = LlamaMLP(cfg).to(torch.bfloat16)
    assert mlp.use_fused_mlps(module) == 1 and mlp.use_fused_mlps(module) == 1
    x = (torch.randn(3, 50, 64) * 2).to(torch.bfloat16)
    gate, up = module.gate_proj(x), module.up_proj(x)
    fused = mlp.swiglu(gate, up)
    assert fused.grad_fn.name() == "_SwiGLUBackward"
    hf = torch.nn.functional.silu(gate) * up
    # the same roundings; exp differs from torch's by < 2e-7 relative, so a value on a
    # rounding boundary may land one step away
    assert ulps(fused, hf).max() <= 1 and (fused != hf).float().mean() < 0.01
    ours, theirs = run(module, x, True), run(module, x, False)
    for a, b in zip(ours, theirs):
        a, b = a.detach(), b.detach()
        scale = b.abs().max()
        torch.testing.assert_close(a, b, rtol=2**-7, atol=float(scale) * 2**-8)


@needs_kernels
def test_the_backward_is_silus_with_torchs_roundings():
    gen = torch.Generator().manual_seed(2)
    gate = (torch.randn(4000, generator=gen) * 4).to(torch.bfloat16).requires_grad_()
    up = torch.randn(4000, generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(4000, generator=gen).to(torch.bfloat16)
    (torch.nn.functional.silu(gate) * up).backward(grad)
    expected = gate.grad, up.grad
    gate.grad = up.grad = None
    mlp.swiglu(gate, up).backward(grad)
    for ours, theirs in zip((gate.grad, up.grad), expected):
        assert ulps(ours, theirs).max() <= 1 and (ours != theirs).float().mean() < 0.01


def test_other_inputs_take_hfs_forward():
    module = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, hidden_act="silu"))
    mlp.use_fused_mlps(module)
    x = torch.randn(2, 16)  # fp32
    assert mlp.swiglu(module.gate_proj(x), module.up_proj(x)) is None
    gate, up = module.gate_proj(x), module.up_proj(x)
    expected = module.down_proj(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(module(x), expected)
    gelu = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, hidden_act="gelu"))
    assert mlp.use_fused_mlps(gelu) == 0
