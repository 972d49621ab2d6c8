"""CopyingAdamW (trainer/cpu/optim.py): torch's fused AdamW update in C, writing each master's
bf16 compute copy in the same pass."""

import pytest
import torch

from asyncrl.trainer.cpu import optim

pytestmark = pytest.mark.skipif(optim._kernels() is None, reason="no C compiler")


def params(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 29), (4099,), (3,)]  # odd sizes: the kernel's blocks and SIMD tails
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_the_update_is_torchs_fused_adamw_and_the_copies_its_bf16_cast():
    # Three steps: weight decay, a learning rate changed between steps, a clip scale on the
    # second, a parameter without a copy and one without a gradient in the last step.
    # Parameters and moments within a few fp32 roundings of torch's; the step counts equal;
    # each copy exactly its master cast to bf16 (torch's rounding).
    ours, theirs = params(0), params(0)
    copies = {id(p): torch.zeros_like(p, dtype=torch.bfloat16) for p in ours[:2]}
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": True}
    mine = optim.CopyingAdamW(ours, copies, **kw)
    ref = torch.optim.AdamW(theirs, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for group in (*mine.param_groups, *ref.param_groups):
            group["lr"] = 1e-2 / (step + 1)
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for opt, ps in ((mine, ours), (ref, theirs)):
            for p, grad in zip(ps, grads, strict=True):
                p.grad = None if (step == 2 and p is ps[1]) else grad.clone()
            opt.grad_scale = torch.tensor(2.5) if step == 1 else None
            opt.step()
        for a, b, start in zip(ours, theirs, params(0), strict=True):
            torch.testing.assert_close(a.data, b.data, rtol=2e-6, atol=1e-7)
            assert not torch.equal(a.data, start.data)
            sa, sb = mine.state[a], ref.state[b]
            assert float(sa["step"]) == float(sb["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sa[key], sb[key], rtol=2e-6, atol=1e-10)
        for p in ours[:2]:
            assert torch.equal(copies[id(p)], p.data.to(torch.bfloat16))
    assert float(mine.state[ours[1]]["step"]) == 2  # no gradient in the last step
    assert mine.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_the_clip_scale_divides_the_gradient():
    # grad / 4 with scale 4 is the update of grad / 4 without: bit for bit (both divide).
    a, b = params(2)[:1], params(2)[:1]
    mine_a = optim.CopyingAdamW(a, {}, lr=1e-2, fused=True)
    mine_b = optim.CopyingAdamW(b, {}, lr=1e-2, fused=True)
    grad = torch.randn(a[0].shape, generator=torch.Generator().manual_seed(3))
    a[0].grad, b[0].grad = grad.clone(), grad / 4
    mine_a.grad_scale = torch.tensor(4.0)
    mine_a.step()
    mine_b.step()
    assert torch.equal(a[0].data, b[0].data)


def test_it_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="amsgrad"):
        optim.CopyingAdamW(params(0), {}, lr=1e-3, amsgrad=True)
    p = params(0)
    with pytest.raises(ValueError, match="copy"):
        optim.CopyingAdamW(p, {id(p[0]): torch.zeros(3, dtype=torch.bfloat16)}, lr=1e-3)
