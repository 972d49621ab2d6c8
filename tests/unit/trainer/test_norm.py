"""The fused RMSNorm (trainer/cpu/norm.py, C) against HF's LlamaRMSNorm and float64."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer.cpu import norm
from asyncrl.trainer.cpu.norm import rms_norm, use_fused_norms
from asyncrl.trainer.cpu.options import set_cpu_paths

pytestmark = pytest.mark.skipif(norm._kernels() is None,
                                reason="no C compiler: HF's norm is used")
D = 96


def make_norm(dtype: torch.dtype = torch.bfloat16) -> LlamaRMSNorm:
    gen = torch.Generator().manual_seed(0)
    module = LlamaRMSNorm(D, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(D, generator=gen) / 4)
    return module.to(dtype)


def run(fn, module, x, g):
    x = x.clone().requires_grad_()
    module.weight.grad = None
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad.clone()


def test_forward_and_backward_are_hfs_to_a_bf16_step_and_as_close_to_float64():
    # Same formulas and bf16 roundings as HF's module and autograd; only the order of the
    # float32 sums of x^2 and of the per-row dot product differ, so a value differs from
    # HF's by at most one bf16 step, and very rarely at all.
    module = make_norm()
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 150, D, generator=gen) * 3).bfloat16()
    g = torch.randn(2, 150, D, generator=gen).bfloat16()
    hf = run(module, module, x, g)
    ours = run(lambda t: rms_norm(t, module.weight, module.variance_epsilon), module, x, g)
    xd = x.double().requires_grad_()
    wd = module.weight.detach().double().requires_grad_()
    yd = wd * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    yd.backward(g.double())
    for name, h, o, truth in zip(("y", "grad x", "grad w"), hf, ours,
                                 (yd.detach(), xd.grad, wd.grad)):
        assert o.dtype == h.dtype == torch.bfloat16 and o.shape == h.shape, name
        step = h.float().abs().clamp_min(1e-30) * 2**-7
        assert bool(((o.float() - h.float()).abs() <= step).all()), name
        assert float((o == h).float().mean()) > 0.999, name
        err_ours = float((o.double() - truth).abs().max())
        err_hf = float((h.double() - truth).abs().max())
        assert err_ours <= 1.01 * err_hf + 1e-6, name


def test_what_it_does_not_cover_runs_hfs_forward_unchanged():
    module = make_norm(torch.float32)
    assert use_fused_norms(module) == 1 and use_fused_norms(module) == 1  # idempotent
    x = torch.randn(4, D)
    assert rms_norm(x, module.weight, 1e-5) is None  # fp32: not covered
    assert torch.equal(module(x), make_norm(torch.float32)(x))


def test_a_models_norms_use_it_and_its_step_matches_hfs(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"),
                                                 dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(2))
    losses, grads = [], []
    for fused in (False, True):
        set_cpu_paths(norm_kernels=fused)
        calls = []
        real = norm._RMSNorm.apply
        monkeypatch.setattr(norm._RMSNorm, "apply",
                            lambda *a, calls=calls, real=real: calls.append(1) or real(*a))
        n_norms = use_fused_norms(model)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert len(calls) == (n_norms if fused else 0)
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert n_norms == 2 * model.config.num_hidden_layers + 1
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert float(cos) > 0.999
