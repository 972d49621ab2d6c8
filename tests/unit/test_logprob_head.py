"""The log-prob head's hand-written backward against plain autograd over a full log-softmax."""

from __future__ import annotations

import pytest
import torch

from asyncrl.training import logprob_head
from asyncrl.training.logprob_head import reference_logprobs, token_logprobs

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
        out = real(*args)
        kept.append(out[2] is not None)
        return out

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
