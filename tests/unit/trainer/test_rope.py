"""The rotary embedding in C (trainer/cpu/rope.py) against HF's function and its autograd in
bf16, bit for bit, on HF's layouts (transposed q and k, grouped key heads)."""

import pytest
import torch
from transformers.models.llama import modeling_llama

from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer.cpu import rope

pytestmark = pytest.mark.skipif(rope._kernels() is None, reason="no C compiler")
HF = getattr(modeling_llama.apply_rotary_pos_emb, "asyncrl_original",
             modeling_llama.apply_rotary_pos_emb)


def inputs(seed: int, batch=2, heads=6, kv_heads=2, n=37, dim=64):
    g = torch.Generator().manual_seed(seed)
    # as HF makes them: projections [B, N, H * D] viewed [B, N, H, D], transposed to [B, H, N, D]
    q = torch.randn(batch, n, heads, dim, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(batch, n, kv_heads, dim, generator=g).bfloat16().transpose(1, 2)
    angles = torch.rand(batch, n, dim // 2, generator=g) * 40  # depths up to 40
    angles = torch.cat([angles, angles], -1)
    grads = [torch.randn(x.shape, generator=g).bfloat16() for x in (q, k)]
    return q, k, angles.cos().bfloat16(), angles.sin().bfloat16(), grads


def run(fn, q, k, cos, sin, grads):
    q, k = (x.detach().clone().requires_grad_() for x in (q, k))
    outs = fn(q, k, cos, sin)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [q.grad, k.grad]


@pytest.mark.parametrize("dim", [64, 40])  # 40: the plain-C tail only (half < 16 lanes)
@pytest.mark.parametrize("threads", [1, 2])
def test_forward_and_backward_equal_hf_bit_for_bit(dim, threads):
    torch.set_num_threads(threads)
    q, k, cos, sin, grads = inputs(0, dim=dim)
    ours = run(rope._fused(HF), q, k, cos, sin, grads)
    theirs = run(HF, q, k, cos, sin, grads)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert a.shape == b.shape and torch.equal(a, b)
    assert ours[0][0].stride() == q.stride()  # the output keeps q's layout
    assert rope.rotate(q, cos, sin) is not None  # the kernel ran, not HF's fallback


def test_inputs_it_does_not_cover_take_hfs_function():
    q, k, cos, sin, _ = inputs(1)
    assert rope.rotate(q.float(), cos.float(), sin.float()) is None
    assert rope.rotate(q, cos.requires_grad_(), sin) is None
    q32, k32, cos32, sin32 = (x.float() for x in (q, k, cos.detach(), sin))
    for a, b in zip(rope._fused(HF)(q32, k32, cos32, sin32), HF(q32, k32, cos32, sin32)):
        assert torch.equal(a, b)


def test_the_model_module_is_pointed_at_it_once(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", HF)
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", arch="llama"))
    assert rope.use_fused_rope(model) and rope.use_fused_rope(model)
    assert modeling_llama.apply_rotary_pos_emb.asyncrl_original is HF
    assert not rope.use_fused_rope(torch.nn.Linear(2, 2))
