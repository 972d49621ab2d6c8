"""The C decode-attention kernel: exact cache writes, fp32-accurate attention, HF parity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.inference.model import Transformer, attention_kernel, decode_attention
from asyncrl.models.tiny import make_tiny_model

kernel = attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler: the torch path is used")


def reference(q, kc, vc, pos):
    """fp32 attention of q [B, H, D] over cache slots 0..B-1 up to pos[b], one row at a time."""
    b, h, d = q.shape
    group = h // kc.shape[1]
    out = torch.empty(b, h, d)
    for i in range(b):
        k = kc[i, :, :pos[i] + 1].float().repeat_interleave(group, 0)
        v = vc[i, :, :pos[i] + 1].float().repeat_interleave(group, 0)
        probs = (q[i, :, None].float() @ k.transpose(-1, -2) * d ** -0.5).softmax(-1)
        out[i] = (probs @ v)[:, 0]
    return out


def run_kernel(q, k, v, kc, vc, pos, threads):
    b, h, _, d = q.shape
    kv, t = kc.shape[1], kc.shape[2]
    out = torch.empty(b, h, 1, d, dtype=torch.bfloat16)
    work = torch.empty(threads * (2 * (h // kv) * d + (h // kv) * t))
    kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
           kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), out.data_ptr(), b, h, kv, d, t,
           d ** -0.5, work.data_ptr(), threads)
    return out


@pytest.mark.parametrize("head_dim", [32, 64, 48])  # 48: the portable loop, not AVX512-BF16
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_writes_the_new_kv_and_matches_fp32_attention(head_dim, threads):
    gen = torch.Generator().manual_seed(head_dim)
    b, h, kv, t = 5, 6, 2, 40
    kc = torch.randn(8, kv, t, head_dim, generator=gen).bfloat16()
    vc = torch.randn(8, kv, t, head_dim, generator=gen).bfloat16()
    qkv = torch.randn(b, 1, h + 2 * kv, head_dim, generator=gen).bfloat16()
    # The engine's layout: q, k, v are head-major views into one row per sequence.
    q = qkv[:, :, :h].transpose(1, 2)
    k, v = qkv[:, :, h:h + kv].transpose(1, 2), qkv[:, :, h + kv:].transpose(1, 2)
    pos = torch.tensor([0, 7, 39, 12, 3])
    expected_k, expected_v = kc.clone(), vc.clone()
    for i in range(b):
        expected_k[i, :, pos[i]] = k[i, :, 0]
        expected_v[i, :, pos[i]] = v[i, :, 0]
    out = run_kernel(q, k, v, kc, vc, pos, threads)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
    ref = reference(q[:, :, 0], kc, vc, pos)
    # fp32 throughout, then one bf16 rounding of outputs |x| < 4: 2^-8 * 4 = 0.016
    torch.testing.assert_close(out[:, :, 0].float(), ref, atol=0.016, rtol=0)
    # position 0 attends to itself only: the output is its own value row, exactly
    assert torch.equal(out[0, :, 0], v[0, :, 0].repeat_interleave(h // kv, 0))


def test_kernel_is_closer_to_fp32_than_the_torch_path():
    gen = torch.Generator().manual_seed(1)
    b, h, kv, d, t = 4, 9, 3, 64, 128
    kc = torch.randn(b, kv, t, d, generator=gen).bfloat16()
    vc = torch.randn(b, kv, t, d, generator=gen).bfloat16()
    qkv = torch.randn(b, 1, h + 2 * kv, d, generator=gen).bfloat16()
    q = qkv[:, :, :h].transpose(1, 2)
    k, v = qkv[:, :, h:h + kv].transpose(1, 2), qkv[:, :, h + kv:].transpose(1, 2)
    pos = torch.tensor([100, 127, 5, 64])
    out = run_kernel(q, k, v, kc, vc, pos, 2)[:, :, 0].float()
    ref = reference(q[:, :, 0], kc, vc, pos)
    bias = torch.zeros(b, 1, t, 1).masked_fill_(
        (torch.arange(t)[None] > pos[:, None])[:, None, :, None], float("-inf"))
    torch_path = decode_attention(q, kc, vc, bias)[:, :, 0].float()
    assert (out - ref).abs().max() <= (torch_path - ref).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_decode_with_kernel_matches_hf_bf16(tmp_path, arch):
    path = make_tiny_model(tmp_path / "m", arch=arch, num_heads=4, num_kv_heads=2,
                           hidden_size=128, head_dim=32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    assert model._attention_kernel is not None
    cache = model.new_cache(3, 64)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([11, 6, 3])
    tokens = torch.randint(3, 300, (3, 11), generator=gen)
    seqs = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    model.prefill(tokens, lengths, cache, slot_start=0)
    positions = lengths.clone()
    for _ in range(4):
        new = torch.randint(3, 300, (3,), generator=gen)
        logits = model.decode(new, positions, cache, kv_len=int(positions.max()) + 1).float()
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            with torch.no_grad():
                ref = hf(torch.tensor([s])).logits[0, -1].float()
            # bf16 activations on both sides, different op order: a few bf16 roundings of
            # logits of magnitude ~5 (as the prefill test allows).
            torch.testing.assert_close(logits[i], ref, atol=0.08, rtol=0)
        positions += 1
