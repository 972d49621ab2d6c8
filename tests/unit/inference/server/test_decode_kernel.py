"""The C decode kernels (kernels/decode.c) against torch computations of the same maths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from asyncrl.inference.server.model import (
    DecodeKernels,
    PackedMatrix,
    Transformer,
    apply_rope,
    linear,
    rms_norm,
)
from asyncrl.models.tiny import make_tiny_model

kernels = DecodeKernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the torch path is used")


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of two bf16 tensors in units of b's last place."""
    a, b = a.float(), b.float()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
    return float(((a - b).abs() / ulp).max())


def test_add_rms_norm_adds_in_place_and_norms_like_the_torch_path():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=gen).bfloat16()
    d = torch.randn(3, 96, generator=gen).bfloat16()
    w = (1 + torch.randn(96, generator=gen) / 4).bfloat16()
    expected_x = x + d  # bf16 add: rounded once
    expected = rms_norm(expected_x, w, 1e-5)
    out, work = torch.empty_like(x), torch.empty(96)
    kernels.add_rms_norm(x.data_ptr(), d.data_ptr(), w.data_ptr(), out.data_ptr(), 3, 96, 1e-5,
                         work.data_ptr())
    assert torch.equal(x, expected_x)
    assert ulps(out, expected) <= 1  # the mean of squares may round differently


def test_silu_mul_matches_torch_bf16():
    gen = torch.Generator().manual_seed(1)
    gu = (torch.randn(4, 2 * 160, generator=gen) * 4).bfloat16()
    gate, up = gu.chunk(2, -1)
    out = torch.empty(4, 160, dtype=torch.bfloat16)
    kernels.silu_mul(gu.data_ptr(), out.data_ptr(), 4, 160)
    assert ulps(out, F.silu(gate) * up) <= 1


def rope_tables(t: int, d: int):
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.outer(torch.arange(t).float(), inv)
    emb = torch.cat((emb, emb), -1)
    half = d // 2
    sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), -1)
    return emb.cos().bfloat16(), sin.bfloat16()


def run_rope_attention(qkv, qn, kn, cos, sin, kc, vc, pos, h, kv, threads=2):
    b, d, t = qkv.shape[0], kc.shape[-1], kc.shape[2]
    group = h // kv
    out = torch.empty(b, h * d, dtype=torch.bfloat16)
    work = torch.empty(threads * (2 * group * d + group * t + d))
    kernels.rope_attention(qkv.data_ptr(), qkv.stride(0),
                           None if qn is None else qn.data_ptr(),
                           None if kn is None else kn.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           kc.data_ptr(), vc.data_ptr(), pos.data_ptr(), out.data_ptr(),
                           b, h, kv, d, t, d ** -0.5, 1e-6, work.data_ptr(), threads)
    return out


@pytest.mark.parametrize("head_dim", [32, 64, 48])  # 48: the portable loop, not AVX512-BF16
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_attention_writes_rotated_kv_and_attends_in_fp32(head_dim, qk_norm, threads):
    gen = torch.Generator().manual_seed(head_dim)
    b, h, kv, t, d = 5, 6, 2, 40, head_dim
    kc = torch.randn(8, kv, t, d, generator=gen).bfloat16()
    vc = torch.randn(8, kv, t, d, generator=gen).bfloat16()
    qkv = torch.randn(b, (h + 2 * kv) * d, generator=gen).bfloat16()
    qn = kn = None
    if qk_norm:
        qn = (1 + torch.randn(d, generator=gen) / 4).bfloat16()
        kn = (1 + torch.randn(d, generator=gen) / 4).bfloat16()
    cos, sin = rope_tables(t, d)
    pos = torch.tensor([0, 7, 39, 12, 3])
    # The torch path's maths: per-head RMSNorm, rotary embedding, both rounding to bf16.
    heads = qkv.view(b, h + 2 * kv, d)
    qk = heads[:, :h + kv]
    if qk_norm:
        qk = rms_norm(qk, torch.cat([qn.expand(h, d), kn.expand(kv, d)]), 1e-6)
    qk = apply_rope(qk, cos[pos][:, None], sin[pos][:, None])
    q, k, v = qk[:, :h], qk[:, h:], heads[:, h + kv:]
    expected_k, expected_v = kc.clone(), vc.clone()
    for i in range(b):
        expected_k[i, :, pos[i]] = k[i]
        expected_v[i, :, pos[i]] = v[i]
    out = run_rope_attention(qkv.clone(), qn, kn, cos, sin, kc, vc, pos, h, kv, threads)
    assert ulps(kc, expected_k) <= 1 and torch.equal(vc, expected_v)
    group = h // kv
    for i in range(b):
        keys = kc[i, :, :pos[i] + 1].float().repeat_interleave(group, 0)
        values = vc[i, :, :pos[i] + 1].float().repeat_interleave(group, 0)
        probs = (q[i, :, None].float() @ keys.transpose(-1, -2) * d ** -0.5).softmax(-1)
        ref = (probs @ values)[:, 0].reshape(-1)
        # fp32 throughout, one bf16 rounding of outputs |x| < 4 at the end: 2^-8 * 4
        torch.testing.assert_close(out[i].float(), ref, atol=0.016, rtol=0)
    # position 0 attends to itself only: its output is its own value row
    assert torch.equal(out[0].view(h, d), v[0].repeat_interleave(group, 0))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_decode_with_kernels_matches_hf_bf16_and_the_torch_path(tmp_path, arch):
    path = make_tiny_model(tmp_path / "m", arch=arch, num_heads=4, num_kv_heads=2,
                           hidden_size=128, head_dim=32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    plain = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    assert model.kernels is not None
    plain.kernels = None  # the torch path, on oneDNN's (or plain) matmuls
    plain.w = plain.read_weights(path)
    assert plain.w.pack != "asyncrl"
    cache, plain_cache = model.new_cache(3, 64), plain.new_cache(3, 64)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([11, 6, 3])
    tokens = torch.randint(3, 300, (3, 11), generator=gen)
    seqs = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    model.prefill(tokens, lengths, cache, slot_start=0)
    plain.prefill(tokens, lengths, plain_cache, slot_start=0)
    positions = lengths.clone()
    for _ in range(4):
        new = torch.randint(3, 300, (3,), generator=gen)
        kv_len = int(positions.max()) + 1
        logits = model.decode(new, positions, cache, kv_len).float()
        torch_path = plain.decode(new, positions, plain_cache, kv_len).float()
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            with torch.no_grad():
                ref = hf(torch.tensor([s])).logits[0, -1].float()
            # bf16 activations on every side, different op order: up to 4 bf16 ulps of logits
            # of magnitude 4-8 (ulp 2^-5); the torch path itself is ~3 ulps from HF.
            torch.testing.assert_close(logits[i], ref, atol=0.125, rtol=0)
        torch.testing.assert_close(logits, torch_path, atol=0.125, rtol=0)
        positions += 1


def _engine_logprob_gap(path: str, actor, use_kernels: bool) -> float:
    """Mean |engine - trainer| log-prob of 4 x 24 sampled tokens, both sides in bf16."""
    from asyncrl.api import Batch, GenerationRequest, SamplingParams, Trajectory
    from asyncrl.config import LocalEngineConfig
    from asyncrl.inference.server.engine import LocalEngine

    engine = LocalEngine(path, LocalEngineConfig(dtype="bfloat16", max_batch_size=4,
                                                 max_seq_len=128), seed=0)
    if not use_kernels:
        engine.model.kernels = None
        engine.model.w = engine.model.read_weights(path)
    done = []
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.submit(GenerationRequest(input_ids=[1, 60 + i, 61, 62, 63], sampling=params),
                      done.append)
    while len(done) < 4:
        engine.step()
    tb = Batch([Trajectory.from_response(r, reward=0.0, group_id="g") for r in done]).to_tensors()
    mask = tb.loss_mask.bool()
    return (actor.compute_logprobs(tb)[mask] - tb.behavior_logprobs[mask]).abs().mean().item()


def test_bf16_engine_logprobs_agree_with_the_bf16_trainer_as_the_torch_path_does(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.config.engine import TrainEngineSpec
    from asyncrl.trainer import FSDPTrainEngine

    path = make_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2, hidden_size=128,
                           head_dim=32)
    cfg = load_config(None, ["train_dataset.path=x", f"actor.path={path}",
                             "actor.dtype=bfloat16"])
    actor = FSDPTrainEngine(TrainEngineSpec.of(cfg.actor), total_steps=1, seed=0)
    actor.initialize()
    try:
        with_kernels = _engine_logprob_gap(path, actor, use_kernels=True)
        torch_path = _engine_logprob_gap(path, actor, use_kernels=False)
    finally:
        actor.destroy()
    print(f"mean |engine - trainer| log-prob: kernels {with_kernels:.4f}, torch {torch_path:.4f}")
    # The trainer runs bf16 matmuls over fp32 master weights (norms in fp32), the engine
    # bf16 throughout: a few hundredths apart on either path; the kernels must not add to it.
    assert with_kernels < 0.05
    assert with_kernels <= 1.5 * torch_path + 0.005


# ---- the packed matmuls ----------------------------------------------------------------------

needs_gemm = pytest.mark.skipif(kernels is None or not kernels.has_gemm,
                                reason="the matmul kernels need AVX512-BF16")


def bf16_matmul_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """x W^T (+ b) in float64 from the bf16 inputs: the exact sum, for ulp comparisons."""
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@needs_gemm
@pytest.mark.parametrize("m", [1, 5, 7, 13, 32])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (80, 96), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_is_the_float32_product_rounded_once(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    for threads in (1, 2, 3):  # odd block counts (80 = 5 blocks) split unevenly
        torch.set_num_threads(threads)
        y = linear(x, PackedMatrix.pack(w), b)
        exact = bf16_matmul_reference(x, w, b)
        # float32 accumulation in another order than the exact sum: within half a bf16 ulp
        # of it plus float32 noise, so at most one ulp from the exact sum rounded to bf16
        assert ulps(y, exact.bfloat16()) <= 1
        assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max() + (
            exact.abs() * 2.0 ** -8).max()
    torch.set_num_threads(2)


@pytest.mark.skipif(kernels is None or not kernels.has_amx, reason="no AMX on this CPU")
@pytest.mark.parametrize("silu", [False, True])
def test_amx_tiles_match_the_avx512_tiles_and_keep_each_row_independent_of_the_batch(silu):
    gen = torch.Generator().manual_seed(7)
    k, n = 576, 160 if not silu else 192
    x = torch.randn(37, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = PackedMatrix.pack(w, silu=silu)
    bias = PackedMatrix.pack_bias(b, silu=silu) if silu else b
    try:
        kernels.use_amx(0)
        avx = linear(x, packed, bias)
        kernels.use_amx(1)
        amx = linear(x, packed, bias)
    finally:
        kernels.use_amx(1)
    assert ulps(amx, avx) <= 2  # two float32 orders of the same sum, each rounded once
    # a row alone (a padded tile), in a whole tile, or in a partial second one: the same bits
    for rows in (slice(0, 1), slice(3, 19), slice(0, 37), slice(30, 37)):
        assert torch.equal(linear(x[rows], packed, bias), amx[rows])


@needs_gemm
def test_packed_gemm_reads_and_writes_strided_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=gen).bfloat16()[:, 8:136]  # row stride 200, k = 128
    w = (torch.randn(64, 128, generator=gen) / 12).bfloat16()
    y = torch.full((6, 100), 7.0, dtype=torch.bfloat16)
    packed = PackedMatrix.pack(w)  # bound: it must outlive the call
    kernels.gemm(x.data_ptr(), 200, 6, 128, packed.data.data_ptr(), 64, None, y.data_ptr(), 100,
                 2)
    assert ulps(y[:, :64], bf16_matmul_reference(x, w, None).bfloat16()) <= 1
    assert torch.equal(y[:, 64:], torch.full((6, 36), 7.0, dtype=torch.bfloat16))  # untouched


@needs_gemm
@pytest.mark.parametrize("m", [1, 9, 32])
def test_packed_gate_up_gives_silu_gate_times_up(m):
    gen = torch.Generator().manual_seed(m)
    i, k = 96, 64
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(2 * i, k, generator=gen) / 4).bfloat16()  # gate rows, then up rows
    b = torch.randn(2 * i, generator=gen).bfloat16()
    packed = PackedMatrix.pack(w, silu=True)
    out = linear(x, packed, PackedMatrix.pack_bias(b, silu=True))
    gate, up = linear(x, PackedMatrix.pack(w), b).chunk(2, -1)  # each rounded to bf16, as torch
    assert out.shape == (m, i)
    assert ulps(out, F.silu(gate) * up) <= 1


@needs_gemm
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_rows_in_one_call_match_the_torch_path_and_fill_the_same_cache(tmp_path, arch):
    path = make_tiny_model(tmp_path / "m", arch=arch, num_heads=4, num_kv_heads=2,
                           hidden_size=128, head_dim=32)
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    plain = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    plain.kernels = None
    plain.w = plain.read_weights(path)
    assert model.w.pack == "asyncrl"
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([13, 4, 9])
    tokens = torch.randint(3, 300, (3, 13), generator=gen)
    cache, plain_cache = model.new_cache(5, 64), plain.new_cache(5, 64)
    last = model.prefill(tokens, lengths, cache, slot_start=2).float()  # slots 2, 3, 4
    expected = plain.prefill(tokens, lengths, plain_cache, slot_start=2).float()
    torch.testing.assert_close(last, expected, atol=0.125, rtol=0)  # as decode: 4 bf16 ulps
    full = model.prefill(tokens, lengths, model.new_cache(5, 64), 2, all_logits=True).float()
    torch.testing.assert_close(full[torch.arange(3), lengths - 1], last, atol=0, rtol=0)
    for i, n in enumerate(lengths.tolist()):
        # keys and values of every prompt position in its own slot; nothing elsewhere
        for ours, theirs in ((cache.k, plain_cache.k), (cache.v, plain_cache.v)):
            # layer 0 comes straight from the embeddings: one matmul rounding apart at most
            assert ulps(ours[0, 2 + i, :, :n], theirs[0, 2 + i, :, :n]) <= 1
            # layer 1's inputs went through layer 0 on both sides: 4 ulps of values up to 4
            torch.testing.assert_close(ours[:, 2 + i, :, :n].float(),
                                       theirs[:, 2 + i, :, :n].float(), atol=0.0625, rtol=0)
            assert not ours[:, 2 + i, :, n:].any()
    assert not cache.k[:, :2].any() and not cache.v[:, :2].any()


@needs_gemm
def test_one_call_mixing_decode_rows_and_a_prompt_equals_separate_calls_bit_for_bit(tmp_path):
    path = make_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2, hidden_size=128,
                           head_dim=32)
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=64)
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, 300, (2, 7), generator=gen)
    new_prompt = torch.randint(3, 300, (1, 5), generator=gen)
    nxt = torch.randint(3, 300, (2,), generator=gen)
    caches = model.new_cache(3, 64), model.new_cache(3, 64)
    for cache in caches:
        model.prefill(prompts, torch.tensor([7, 4]), cache, slot_start=0)
    # separately: decode slots 0-1, then prefill the new prompt into slot 2
    decoded = model.decode(nxt, torch.tensor([7, 4]), caches[0], 8)
    prefilled = model.prefill(new_prompt, torch.tensor([5]), caches[0], slot_start=2)
    # one call: rows = the two decode tokens, then the prompt's five
    mixed = model.forward_rows(torch.cat([nxt, new_prompt[0]]),
                               torch.tensor([0, 1, 2, 2, 2, 2, 2]),
                               torch.tensor([7, 4, 0, 1, 2, 3, 4]), caches[1],
                               torch.tensor([0, 1, 6]))
    assert torch.equal(mixed, torch.cat([decoded, prefilled]))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_a_build_without_avx512_has_the_per_op_kernels_and_the_sampler_only(tmp_path):
    import ctypes
    import shutil
    import subprocess
    from importlib import resources

    cc = shutil.which("cc") or shutil.which("gcc")
    src = resources.files("asyncrl.kernels") / "decode.c"
    lib_path = tmp_path / "decode_avx2.so"
    flags = [f for f in __import__("asyncrl.kernels", fromlist=["FLAGS"]).FLAGS
             if not f.startswith("-march")]
    subprocess.run([cc, *flags, "-march=x86-64-v3", str(src), "-o", str(lib_path), "-lm"],
                   check=True, capture_output=True)
    portable = DecodeKernels(ctypes.CDLL(str(lib_path)))
    assert not portable.has_gemm  # the packed matmuls need AVX512-BF16: oneDNN's run instead
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=gen).bfloat16()
    d = torch.randn(3, 96, generator=gen).bfloat16()
    w = (1 + torch.randn(96, generator=gen) / 4).bfloat16()
    outs, work = [], torch.empty(96)  # every buffer bound to a name: alive during the call
    for k in (kernels, portable):
        xx, out = x.clone(), torch.empty_like(x)
        k.add_rms_norm(xx.data_ptr(), d.data_ptr(), w.data_ptr(), out.data_ptr(), 3, 96, 1e-5,
                       work.data_ptr())
        outs.append(out)
    assert ulps(outs[1], outs[0]) <= 1
    logits = (torch.randn(2, 300, generator=gen) * 3).bfloat16()
    tokens, logprobs = torch.empty(2, dtype=torch.long), torch.empty(2)
    zeros, work = torch.zeros(2), torch.empty(2 * 302)
    portable.sample_rows(logits.data_ptr(), 2, 300, zeros.data_ptr(), zeros.data_ptr(),
                         tokens.data_ptr(), logprobs.data_ptr(), work.data_ptr(), 2)
    assert tokens.tolist() == logits.float().argmax(-1).tolist()  # temperature 0: greedy
    expected = logits.float().log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
