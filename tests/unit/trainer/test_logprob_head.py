"""The log-prob head's hand-written backward against plain autograd over a full log-softmax."""

from __future__ import annotations

import pytest
import torch

from asyncrl.trainer.cpu import logprob_head
from asyncrl.trainer.cpu.logprob_head import reference_logprobs, token_logprobs
from asyncrl.trainer.cpu.options import set_cpu_paths

N, H, V = 11, 16, 50


def inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)  # dL/dlogprob, e.g. advantages
    return hidden, weight, tokens, upstream


def grads(fn, hidden, weight, tokens, upstream):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, tokens)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


# (chunk elements, template bytes): one chunk kept; 3 rows per chunk all kept; 3 rows per
# chunk none kept (every chunk recomputed in backward); the budget running out midway.
LAYOUTS = [(2**25, 2**28), (3 * V, 2**28), (3 * V, 0), (3 * V, 2 * 3 * V * 8)]


@pytest.mark.parametrize("chunk,budget", LAYOUTS, ids=["one", "kept", "recomputed", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_logprobs_and_gradients_equal_autograd(monkeypatch, chunk, budget, temperature):
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(logprob_head, "SAVED_TEMPLATE_BYTES", budget)
    args = inputs(torch.float32)
    ours = grads(lambda h, w, t: token_logprobs(h, w, t, temperature)[0], *args)
    ref = grads(lambda h, w, t: reference_logprobs(h, w, t, temperature), *args)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_gradients_are_autograds_to_bf16_rounding(monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * V)
    hidden, weight, tokens, upstream = inputs(torch.bfloat16)
    exact = grads(reference_logprobs, *(x.detach().double().requires_grad_()
                                        for x in (hidden, weight)), tokens, upstream.double())
    ours = grads(lambda h, w, t: token_logprobs(h, w, t)[0], hidden, weight, tokens, upstream)
    ref = grads(reference_logprobs, hidden, weight, tokens, upstream)
    for mine, autograd, truth in zip(ours, ref, exact):
        # No further from the float64 truth than autograd's own bf16 result, give or take.
        err_mine = float((mine.double() - truth).abs().max())
        err_ref = float((autograd.double() - truth).abs().max())
        assert err_mine <= 1.5 * err_ref + 1e-3 * float(truth.abs().max())


def test_entropy_is_that_of_the_tempered_softmax_and_changes_nothing_else(monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * V)
    hidden, weight, tokens, upstream = inputs(torch.float32)
    plain = grads(lambda h, w, t: token_logprobs(h, w, t, 0.7)[0], hidden, weight, tokens,
                  upstream)
    both = grads(lambda h, w, t: token_logprobs(h, w, t, 0.7, with_entropy=True)[0], hidden,
                 weight, tokens, upstream)
    assert all(torch.equal(a, b) for a, b in zip(plain, both))
    _, entropy = token_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
    logp = ((hidden @ weight.t()) / 0.7).log_softmax(-1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad


def test_without_gradients_nothing_is_kept(monkeypatch):
    kept = []
    real = logprob_head._chunk_forward

    def spy(*args):
        kept.append(args[-1] is not None)  # the template buffer to fill, or None
        return real(*args)

    monkeypatch.setattr(logprob_head, "_chunk_forward", spy)
    hidden, weight, tokens, _ = inputs(torch.float32)
    with torch.no_grad():
        token_logprobs(hidden, weight, tokens)
    token_logprobs(hidden, weight, tokens)
    assert kept == [False, True]


def test_bad_shapes_are_named():
    hidden, weight, tokens, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="hidden must be"):
        token_logprobs(hidden[None], weight, tokens)


def test_tokens_outside_the_vocabulary_are_named():
    hidden, weight, tokens, _ = inputs(torch.bfloat16)
    tokens[3] = V
    with pytest.raises(ValueError, match=rf"\[0, {V}\).*got \[\d+, {V}\]"):
        token_logprobs(hidden, weight, tokens)


needs_kernels = pytest.mark.skipif(logprob_head._kernels() is None,
                                   reason="no C compiler: the torch path is used")


def chunk_both_ways(seed: int, temperature: float):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(7, H, generator=gen) * 3).to(torch.bfloat16)
    w = torch.randn(300, H, generator=gen).to(torch.bfloat16)
    tok = torch.randint(0, 300, (7,), generator=gen)
    paths = []
    for forward in (logprob_head._chunk_forward, logprob_head._chunk_forward_c):
        template = torch.empty(7, 300, dtype=torch.bfloat16)
        paths.append((*forward(h, w, tok, temperature, True, template), template))
    return h, w, tok, *paths


@needs_kernels
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_c_chunk_equals_the_torch_chunk(temperature):
    # The same fp32 formulas on the same bf16 logits; exp's polynomial (rel. error < 2e-7)
    # and the order of the sums differ. Against float64 on those logits: log-probs as close
    # as torch's; the entropy closer (torch's path takes sum p z from logsumexp, losing
    # digits when the logits are large; the kernel sums p (z - max)). Templates: each value
    # rounded once to bf16, so they agree to one bf16 step at most, and nearly all (> 95%) exactly.
    h, w, tok, (lp, ent, tmpl), (lp_c, ent_c, tmpl_c) = chunk_both_ways(0, temperature)
    logp = ((h @ w.t()).double() / temperature).log_softmax(-1)
    true_lp, true_ent = logp.gather(-1, tok[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    assert float((lp_c - true_lp).abs().max()) < 1e-5
    assert float((lp - true_lp).abs().max()) < 1e-5
    assert float((ent_c - true_ent).abs().max()) < 1e-6 < float((ent - true_ent).abs().max())
    assert tmpl_c.dtype == torch.bfloat16 and tmpl_c.shape == tmpl.shape
    step = tmpl.float().abs().clamp_min(1e-30) * 2**-7  # one bf16 step (upper bound)
    assert bool(((tmpl_c.float() - tmpl.float()).abs() <= step).all())
    assert float((tmpl_c == tmpl).float().mean()) > 0.95
    rows = torch.arange(len(tok))
    assert bool((tmpl_c[rows, tok] > 0).all()) and bool((tmpl_c.float().sum(-1).abs() < 0.05).all())


@needs_kernels
@pytest.mark.parametrize("chunk,budget", LAYOUTS, ids=["one", "kept", "recomputed", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_kernels_match_the_torch_path(monkeypatch, chunk, budget, temperature):
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(logprob_head, "SAVED_TEMPLATE_BYTES", budget)
    hidden, weight, tokens, upstream = inputs(torch.bfloat16, seed=3)
    results, real = {}, logprob_head._kernels
    for use in (False, True):
        set_cpu_paths(logprob_kernels=use)
        calls: list[int] = []

        def counted(calls=calls):
            calls.append(1)
            return real()

        monkeypatch.setattr(logprob_head, "_kernels", counted)
        out = grads(lambda h, w, t: token_logprobs(h, w, t, temperature)[0], hidden, weight,
                    tokens, upstream)
        _, entropy = token_logprobs(hidden, weight, tokens, temperature, with_entropy=True)
        results[use] = (*out, entropy)
        assert bool(calls) == use  # the kernels ran exactly when switched on
    for c, t in zip(results[True], results[False]):
        # The gradients are products of bf16 templates that differ by at most one step in a
        # few places: bf16 matmul results one step apart at most.
        torch.testing.assert_close(c.float(), t.float(), atol=1e-5, rtol=2**-7)


@needs_kernels
def test_the_scaled_template_is_rounded_once_as_autograd_rounds_it():
    gen = torch.Generator().manual_seed(1)
    template = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    g = torch.randn(5, generator=gen) * 1e-3
    expected = (template.float() * g[:, None]).to(torch.bfloat16)
    logprob_head._kernels().scale_rows_bf16(template.data_ptr(), 5, 300, g.data_ptr(), 2)
    assert torch.equal(template, expected)


def run_backward(out: torch.Tensor, upstream: torch.Tensor, *leaves: torch.Tensor):
    for leaf in leaves:
        leaf.grad = None
    (out * upstream).sum().backward()
    return out.detach(), *(leaf.grad.clone() for leaf in leaves)


@pytest.mark.parametrize("use_kernels", [False, True])
def test_a_freed_template_buffer_serves_the_next_call_and_no_two_at_once(monkeypatch,
                                                                         use_kernels):
    if use_kernels and logprob_head._kernels() is None:
        pytest.skip("no C compiler: the torch path is used")
    set_cpu_paths(logprob_kernels=use_kernels)
    monkeypatch.setattr(logprob_head, "ROW_MULTIPLE", 1)  # buffers of exactly N rows
    spare = logprob_head._Spare()
    monkeypatch.setattr(logprob_head, "_spare", spare)
    first = inputs(torch.bfloat16, seed=5)
    second = inputs(torch.bfloat16, seed=6)

    def call(args):
        hidden, weight, tokens, _ = args
        return token_logprobs(hidden, weight, tokens, 0.7)[0]

    # Each call on its own, with a fresh buffer every time: the numbers to match.
    set_cpu_paths(keep_spare_templates=False)
    alone = [run_backward(call(a), a[3], a[0], a[1]) for a in (first, second)]
    assert spare._buffer is None
    set_cpu_paths(keep_spare_templates=True)
    assert torch.equal(run_backward(call(first), first[3], first[0], first[1])[0], alone[0][0])
    spare._buffer[:N * V].fill_(7.0)  # stale values must not leak into a result
    kept = spare._buffer.data_ptr()
    # reserved for the most any call takes, not for this call's rows
    assert spare._buffer.numel() * 2 == logprob_head.SAVED_TEMPLATE_BYTES

    # The next call takes the kept buffer and gives it back after its backward.
    again = run_backward(call(first), first[3], first[0], first[1])
    assert spare._buffer.data_ptr() == kept
    # Two forwards before either backward (another model's head, a pipeline): the second
    # cannot get the buffer the first still holds, or the first's gradient would be the
    # second's. Both match their calls alone.
    out_a, out_b = call(first), call(second)
    assert spare._buffer is None
    both = [run_backward(out_a, first[3], first[0], first[1]),
            run_backward(out_b, second[3], second[0], second[1])]
    for got, want in zip([again, *both], [alone[0], *alone]):
        for x, y in zip(got, want):
            assert torch.equal(x, y)
    assert spare._buffer.numel() * 2 == logprob_head.SAVED_TEMPLATE_BYTES  # one of the two

    # A call with more rows than any before takes the same buffer: a new high of loss
    # tokens touches only its extra rows, not a whole new buffer.
    hidden, weight, tokens, upstream = inputs(torch.bfloat16, seed=7)
    more = torch.cat([hidden.detach(), hidden.detach()]).requires_grad_()
    run_backward(token_logprobs(more, weight, torch.cat([tokens, tokens]))[0],
                 torch.cat([upstream, upstream]), more, weight)
    assert spare._buffer.data_ptr() == kept


@needs_kernels
def test_a_forward_without_gradient_computes_its_logits_in_the_kept_buffer(monkeypatch):
    spare = logprob_head._Spare()
    monkeypatch.setattr(logprob_head, "_spare", spare)
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 4 * V)  # 3 chunks of 4 rows
    hidden, weight, tokens, upstream = inputs(torch.bfloat16, seed=8)
    run_backward(token_logprobs(hidden, weight, tokens)[0], upstream, hidden, weight)
    kept = spare._buffer.data_ptr()
    spare._buffer.fill_(-3.0)
    with torch.no_grad():
        ours = token_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
        set_cpu_paths(keep_spare_templates=False)
        fresh = token_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
    assert spare._buffer.data_ptr() == kept
    for a, b in zip(ours, fresh):
        assert torch.equal(a, b)


@needs_kernels
def test_rows_rounded_up_give_the_exact_counts_numbers(monkeypatch):
    hidden, weight, tokens, upstream = inputs(torch.bfloat16, seed=9)
    results, shapes = {}, []
    real_mm = torch.mm

    def mm(a, b, **kwargs):
        shapes.append(a.shape[0])
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    for multiple in (1, 8):
        monkeypatch.setattr(logprob_head, "ROW_MULTIPLE", multiple)
        shapes.clear()
        out = grads(lambda h, w, t: token_logprobs(h, w, t, 0.7)[0], hidden, weight, tokens,
                    upstream)
        with torch.no_grad():
            entropy = token_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)[1]
        results[multiple] = (*out, entropy)
        assert shapes[0] == (N if multiple == 1 else 16)  # the forward's product: 11 -> 16 rows
    for padded, exact in zip(results[8], results[1]):
        assert padded.shape == exact.shape  # the padding rows' results are dropped
        torch.testing.assert_close(padded.float(), exact.float(), atol=1e-6, rtol=2**-8)
