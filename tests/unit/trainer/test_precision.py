"""The compute copies' gradient sink (trainer/cpu/precision.py) on its own."""

import pytest
import torch
from torch import nn

from asyncrl.trainer.cpu import precision
from asyncrl.trainer.cpu.options import set_cpu_paths
from asyncrl.trainer.cpu.precision import ComputeWeights


def lookup_grad(module: nn.Embedding, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    module.weight.grad = None
    (module(ids) * weights).sum().backward()
    return module.weight.grad.clone()


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_rows_reach_the_master_as_autograd_sums_them(padding_idx):
    gen = torch.Generator().manual_seed(0)
    module = nn.Embedding(50, 8, padding_idx=padding_idx)
    ids = torch.tensor([[3, 7, 7, 1], [3, 0, 49, 7]])  # repeats, the padding id
    weights = torch.randn(2, 4, 8, generator=gen)
    expected = lookup_grad(module, ids, weights)
    module.weight.grad = None
    copies = ComputeWeights(module, torch.float32)
    with copies.active():
        out = precision.embedding(module, ids)
        assert out is not None
        (out * weights).sum().backward()
        assert module.weight.grad is None  # nothing went through autograd's accumulation
    master = module.weight
    torch.testing.assert_close(master.grad, expected, rtol=1e-6, atol=1e-6)
    if padding_idx is not None:
        assert not master.grad[padding_idx].any()
    assert not master.grad[2].any() and master.grad[7].abs().sum() > 0


def test_embedding_without_a_sink_is_left_to_the_module(monkeypatch):
    module = nn.Embedding(10, 4)
    ids = torch.tensor([1, 2])
    assert precision.embedding(module, ids) is None  # not inside ComputeWeights
    copies = ComputeWeights(module, torch.float32)
    with copies.active():
        with torch.no_grad():
            assert precision.embedding(module, ids) is None
        set_cpu_paths(grads_to_master=False)
        assert precision.embedding(module, ids) is None
        set_cpu_paths(grads_to_master=True)
        scaled = nn.Embedding(10, 4, max_norm=1.0)
        assert precision.embedding(scaled, ids) is None  # max_norm renormalises: not ours


def test_masters_are_cast_again_only_after_they_change():
    module = nn.Linear(4, 4, bias=False)
    copies = ComputeWeights(module, torch.bfloat16)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, fused=True)
    copies.watch(optimizer)
    master = module.weight
    with copies.active():
        copy = module.weight
        assert copy is not master and torch.equal(copy, master.to(torch.bfloat16))
        with torch.no_grad():
            copy.fill_(7)  # a mark: survives while the masters do not change
    with copies.active():
        assert module.weight is copy and bool((copy == 7).all())
    master.grad = torch.ones_like(master)
    optimizer.step()  # the fused AdamW does not move the version counter
    with copies.active():
        assert torch.equal(copy, master.detach().to(torch.bfloat16))
        with torch.no_grad():
            copy.fill_(7)
    with torch.no_grad():
        master.mul_(2)  # an in-place write, as a state load does
    with copies.active():
        assert torch.equal(copy, master.detach().to(torch.bfloat16))
        with torch.no_grad():
            copy.fill_(7)
    copies.invalidate()
    with copies.active():
        assert torch.equal(copy, master.detach().to(torch.bfloat16))
