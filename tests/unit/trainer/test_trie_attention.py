"""The trie attention's matmul path on the CPU in bf16 (trainer/cpu/attention.py): its C softmax
against torch's, and its forward and backward against float64 attention on the same inputs.

The path rounds the scores to bf16 before the softmax and each matmul's output once; SDPA's
flash kernel keeps the scores in float32. Observed against float64 (random inputs, unit
variance): both within 0.6% of each tensor's largest entry, the matmul path no worse than
flash by more than 2x on any. The tolerance, 1% of the largest entry, is ~2.5 bf16 epsilons;
a key wrongly allowed or hidden moves the output by >10%.
"""

import pytest
import torch

from asyncrl.trainer.cpu import attention

pytestmark = pytest.mark.skipif(attention._kernels() is None, reason="no C compiler")

TOL = 0.01  # of each tensor's largest entry


def trie_mask(rows: int, width: int) -> torch.Tensor:
    """[R, 1, L, L]: a prompt of 10 nodes, then two branches (the second hides the first),
    as the pack lays out a group of two samples; the last row's tail is padding."""
    mask = torch.ones(width, width, dtype=torch.bool).tril()
    mask[25:, 10:25] = False  # branch 2 (nodes 25..) does not see branch 1 (10..24)
    mask = mask.repeat(rows, 1, 1, 1)
    mask[-1, :, width - 5:] = False
    mask[-1, 0, width - 5:, width - 5:] = torch.eye(5, dtype=torch.bool)  # padding sees itself
    return mask


def reference(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, 1) for x in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def inputs(seed: int, rows=3, heads=6, kv_heads=2, width=40, dim=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, width, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, width, dim, generator=g) for _ in range(2))
    grad = torch.randn(rows, heads, width, dim, generator=g)
    return [x.to(torch.bfloat16) for x in (q, k, v, grad)], trie_mask(rows, width)


def test_c_softmax_equals_torch_masked_softmax():
    g = torch.Generator().manual_seed(0)
    rows, heads, width, scale = 2, 3, 37, 0.3
    mask = trie_mask(rows, width)
    scores = (4 * torch.randn(rows, heads, width, width, generator=g)).to(torch.bfloat16)
    probs = torch.empty_like(scores)
    attention._kernels().masked_softmax_fwd_bf16(
        scores.data_ptr(), mask.contiguous().view(torch.uint8).data_ptr(), rows, heads, width,
        scale, probs.data_ptr(), 2)
    expected = torch.softmax((scores.float() * scale).masked_fill(~mask, float("-inf")), -1)
    assert (probs[~mask.expand_as(probs)] == 0).all()
    # float32 inside, rounded once: within one bf16 rounding of the float32 result
    torch.testing.assert_close(probs.float(), expected, rtol=2**-8, atol=1e-30)


def test_c_softmax_gradient_equals_autograd():
    g = torch.Generator().manual_seed(1)
    n, width, scale = 50, 29, 0.125
    logits = torch.randn(n, width, generator=g)
    logits[:, 20:] = float("-inf")  # masked keys: probability 0, gradient 0
    probs = torch.softmax(logits, -1).to(torch.bfloat16)
    grad_probs = torch.randn(n, width, generator=g).to(torch.bfloat16)
    out = torch.empty_like(probs)
    attention._kernels().masked_softmax_bwd_bf16(probs.data_ptr(), grad_probs.data_ptr(), n,
                                                 width, scale, out.data_ptr(), 2)
    p, dp = probs.float(), grad_probs.float()
    expected = scale * p * (dp - (p * dp).sum(-1, keepdim=True))
    assert (out[:, 20:] == 0).all()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matmul_attention_forward_and_backward_equal_float64(seed):
    (q, k, v, grad), mask = inputs(seed)
    scale = q.shape[-1] ** -0.5
    results = {}
    for name in ("float64", "flash", "matmul"):
        leaves = [x.clone().double() if name == "float64" else x.clone() for x in (q, k, v)]
        for x in leaves:
            x.requires_grad_()
        if name == "float64":
            out = reference(*leaves, mask, scale)
        elif name == "flash":
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = attention._MatmulAttention.apply(*leaves, mask, scale)
        out.backward(grad.to(out.dtype))
        results[name] = [t.detach().double() for t in (out, *(x.grad for x in leaves))]
    for label, got, flash, want in zip(("out", "dq", "dk", "dv"), results["matmul"],
                                       results["flash"], results["float64"]):
        error, top = float((got - want).abs().max()), float(want.abs().max())
        assert error <= TOL * top, (label, error / top)
        assert error <= 2 * float((flash - want).abs().max()) + 1e-3 * top, label


def test_a_hidden_key_changes_the_output():
    """The tolerance above is far below what a mask error does."""
    (q, k, v, _), mask = inputs(0)
    wrong = mask.clone()
    wrong[:, :, 30, 5] = False
    right = attention._MatmulAttention.apply(q, k, v, mask, 0.2).double()
    moved = attention._MatmulAttention.apply(q, k, v, wrong, 0.2).double()
    assert float((right - moved).abs().max()) > 10 * TOL * float(right.abs().max())


def test_the_trie_attention_runs_the_matmul_path_within_the_byte_budget_and_flash_past_it(
        monkeypatch):
    (q, k, v, _), mask = inputs(0, rows=1)
    slots = torch.arange(q.shape[2])

    def trie():  # one packed row holding the nodes in order: [1, H, N, D] on the nodes
        return attention.trie_attention(torch.nn.Module(), q, k, v, mask, trie_slots=slots)[0][0]

    scale = q.shape[-1] ** -0.5
    matmul = attention._MatmulAttention.apply(q, k, v, mask, scale)[0].transpose(0, 1)
    flash = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert not torch.equal(matmul, flash)  # the two paths are told apart by their roundings
    torch.testing.assert_close(trie(), matmul, atol=0, rtol=0)
    monkeypatch.setattr(attention, "MATMUL_ATTENTION_BYTES", 0)
    torch.testing.assert_close(trie(), flash, atol=0, rtol=0)


def test_the_gather_from_rows_equals_indexing_forward_and_backward():
    """`_FromRows` (index_copy backward) against autograd's x[slots], bit for bit."""
    g = torch.Generator().manual_seed(0)
    rows, heads, width, dim = 3, 4, 10, 8
    slots = torch.randperm(rows * width, generator=g)[:22]  # distinct, unordered, with gaps
    x = torch.randn(rows, heads, width, dim, generator=g, dtype=torch.bfloat16)
    grad = torch.randn(22, heads, dim, generator=g, dtype=torch.bfloat16)
    ours, theirs = (x.clone().requires_grad_() for _ in range(2))
    out = attention._FromRows.apply(ours, slots)
    ref = theirs.transpose(1, 2).flatten(0, 1)[slots]
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(ours.grad, theirs.grad)
    assert int((ours.grad != 0).any(-1).any(1).sum()) == 22  # the other slots get zeros


def test_the_c_moves_between_nodes_and_rows_equal_torch_indexing_forward_and_backward():
    """The matmul path's moves in C (`_ToRows`, `_RowsToNodes`) against the torch moves
    (`_to_rows`, `_FromRows`) around the same `_MatmulAttention`, bit for bit: nodes in an
    unordered subset of the slots (gaps are padding), q, k, v node-major as HF lays them."""
    g = torch.Generator().manual_seed(1)
    rows, heads, kv_heads, width, dim, n = 3, 6, 2, 40, 32, 97
    mask = trie_mask(rows, width)
    slots = torch.randperm(rows * width, generator=g)[:n]

    def node_major(h):  # [1, h, N, D] viewed from [1, N, h, D], as q_proj(...).transpose(1, 2)
        x = torch.randn(1, n, h, dim, generator=g).to(torch.bfloat16).transpose(1, 2)
        return x.requires_grad_()

    q, k, v = node_major(heads), node_major(kv_heads), node_major(kv_heads)
    grad = torch.randn(1, n, heads, dim, generator=g).to(torch.bfloat16)
    ours = attention.trie_attention(torch.nn.Module(), q, k, v, mask, trie_slots=slots)[0]
    ours.backward(grad)
    ours_grads = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    moved = [attention._to_rows(x, slots, rows, width) for x in (q, k, v)]
    out = attention._MatmulAttention.apply(*moved, mask, dim ** -0.5)
    theirs = attention._FromRows.apply(out, slots)[None]
    theirs.backward(grad)
    assert torch.equal(ours, theirs)
    for mine, x in zip(ours_grads, (q, k, v), strict=True):
        assert torch.equal(mine, x.grad)
        assert mine.abs().sum() > 0
