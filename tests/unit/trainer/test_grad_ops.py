"""The trainer's gradient passes in C (trainer/cpu/grad_ops.py) and the linear layers whose
weight gradient uses them (trainer/cpu/linear.py)."""

import pytest
import torch
from torch import nn

from asyncrl.trainer.cpu import grad_ops, linear
from asyncrl.trainer.cpu.options import set_cpu_paths, use_cpu_paths

needs_kernels = pytest.mark.skipif(grad_ops._kernels() is None, reason="no C compiler")


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (33, 70), (64, 32), (130, 97)])
def test_transpose_is_exact_for_any_shape_and_row_stride(shape):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(shape[0], shape[1] + 9, generator=gen).to(torch.bfloat16)
    for x in (wide[:, :shape[1]].contiguous(), wide[:, 4:4 + shape[1]]):  # ld = cols, ld > cols
        out = grad_ops.transposed(x)
        assert out.is_contiguous() and torch.equal(out, x.t())


@needs_kernels
def test_widened_add_equals_torchs_fp32_add(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    total = torch.randn(3, 100_003, generator=gen)
    part = (torch.randn(3, 100_003, generator=gen) * 1e-3).to(torch.bfloat16)
    expected = total + part.float()
    for kernels in (True, False):
        set_cpu_paths(grad_kernels=kernels)
        out = total.clone()
        grad_ops.add_widened(out, part)
        assert torch.equal(out, expected), kernels
    strided = total.clone().t()  # not contiguous: torch's own add_
    grad_ops.add_widened(strided, part.t())
    assert torch.equal(strided, expected.t())


@needs_kernels
def test_t_matmul_equals_the_transposed_product_in_chunks(monkeypatch):
    # x^T @ y through contiguous chunks of x^T (3 of 40 rows and a tail of 23): each output
    # element is the same fp32 dot product rounded once, so within one bf16 rounding of
    # torch's, and of float64; into a given buffer, and from x with rows wider than used.
    monkeypatch.setattr(grad_ops, "TRANSPOSED_ROWS", 40)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 150, generator=gen).to(torch.bfloat16)
    x, y = wide[:, :143], torch.randn(37, 24, generator=gen).to(torch.bfloat16)
    out = torch.full((143, 24), 7.0, dtype=torch.bfloat16)
    assert grad_ops.t_matmul(x, y, out=out) is out
    exact = x.double().t() @ y.double()
    step = exact.abs() * 2**-8 + 1e-6
    assert bool(((out.double() - exact).abs() <= step).all())
    assert bool(((out.double() - (x.t() @ y).double()).abs() <= 2 * step).all())


@needs_kernels
def test_total_norm_equals_float64_over_tensors_of_any_size():
    # Sizes around the kernel's blocks (16k per thread share, 4096 per float sum), the
    # threads' shares crossing tensor boundaries; against float64, to fp32 precision.
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=gen) * s
               for n, s in ((1, 3.0), (4095, 1.0), (16385, 1e-3), (70_001, 2.0), (5, 1e2))]
    tensors.append(torch.randn(33, 65, generator=gen))
    exact = torch.cat([t.double().flatten() for t in tensors]).norm()
    before = torch.get_num_threads()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            norm = grad_ops.total_norm(tensors)
        finally:
            torch.set_num_threads(before)
        assert norm.dtype == torch.float32 and norm.dim() == 0
        torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(tensors), rtol=1e-6, atol=0)
    assert grad_ops.total_norm([t.t() for t in tensors[-1:]]) is None  # not contiguous
    assert grad_ops.total_norm([tensors[0].double()]) is None


def linear_grads(module, x, use):
    with use_cpu_paths(contiguous_linear=use):
        x = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        y = module(x)
        assert (y.grad_fn.name() == "_LinearBackward") == (use and x.dtype == torch.bfloat16)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        return y, x.grad, module.weight.grad, module.bias.grad


@pytest.mark.parametrize("seed", [0, 1])
def test_linear_gradients_match_autograd_and_float64(seed):
    # Forward and the input's gradient are autograd's ops (bit for bit); the weight's is the
    # same product from another operand layout: within a bf16 rounding of autograd's, and
    # no further from the float64 gradient than autograd's own.
    gen = torch.Generator().manual_seed(seed)
    module = nn.Linear(96, 160).to(torch.bfloat16)
    assert linear.use_contiguous_weight_grads(module) == 1
    assert linear.use_contiguous_weight_grads(module) == 1  # idempotent
    x = torch.randn(2, 150, 96, generator=gen).to(torch.bfloat16)
    ours = linear_grads(module, x, True)
    theirs = linear_grads(module, x, False)
    for a, b in zip(ours[:2], theirs[:2]):
        assert torch.equal(a, b)
    ref = nn.Linear(96, 160).double()
    ref.load_state_dict(module.state_dict())
    exact = linear_grads(ref, x.double(), False)
    for i in (2, 3):  # weight, bias
        scale = exact[i].abs().max()
        ours_err = (ours[i].double() - exact[i]).abs().max() / scale
        theirs_err = (theirs[i].double() - exact[i]).abs().max() / scale
        assert ours_err <= max(2 * theirs_err, 2**-8), (i, ours_err, theirs_err)
        torch.testing.assert_close(ours[i], theirs[i], rtol=2**-7, atol=float(scale) * 2**-8)


def test_linear_outside_bf16_cpu_is_nn_linear():
    module = nn.Linear(8, 4)
    linear.use_contiguous_weight_grads(module)
    x = torch.randn(3, 8, requires_grad=True)
    y = module(x)
    assert y.grad_fn.name() != "_LinearBackward"  # fp32: nn.Linear's own graph
    torch.testing.assert_close(y, x @ module.weight.t() + module.bias)
