"""Sampling: truncation, recorded log-probs, stop conditions, and parity with HF."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.api.types import GenerationRequest, SamplingParams, StopReason
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.model import DecodeKernels
from asyncrl.inference.server.sampling import (
    SamplingBatch,
    StopChecker,
    sample,
    sample_from,
    truncate,
)
from asyncrl.models.tiny import make_tiny_model

torch.set_num_threads(1)
FP32_TOL = 1e-4  # our fp32 forward vs HF's: same maths, different op order


def _batch(*params: SamplingParams) -> SamplingBatch:
    return SamplingBatch.from_params(list(params))


# ---- the sampler on hand-made logits ----------------------------------------------------------

def test_greedy_picks_argmax_and_records_untempered_logprob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, logprobs = sample(logits, _batch(SamplingParams(temperature=0.0)))
    # 3 - log(e^1 + e^3 + e^2) = 3 - log(30.19287) = -0.40760596
    assert tokens.tolist() == [1]
    assert logprobs.item() == pytest.approx(-0.40760596, abs=1e-6)


def test_sampled_logprob_is_tempered_and_taken_before_truncation():
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]]))  # probabilities 1/8, 2/8, 5/8
    tokens, logprobs = sample(logits, _batch(SamplingParams(temperature=1.0, top_k=1)))
    # top_k=1 forces token 2, but the recorded log-prob is the untruncated log(5/8).
    assert tokens.tolist() == [2]
    assert logprobs.item() == pytest.approx(math.log(5 / 8), abs=1e-6)
    tokens, logprobs = sample(logits, _batch(SamplingParams(temperature=0.5, top_k=1)))
    # logits / 0.5 = 2 log p: probabilities 1:4:25, so log(25/30).
    assert logprobs.item() == pytest.approx(math.log(25 / 30), abs=1e-6)


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    greedy, _ = sample(logits, _batch(*[SamplingParams(temperature=0.0)] * 16))
    top1, _ = sample(logits, _batch(*[SamplingParams(temperature=1.3, top_k=1)] * 16),
                     torch.Generator().manual_seed(1))
    assert torch.equal(greedy, top1)


def test_top_p_keeps_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(4000, 3)
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits, _batch(*[SamplingParams(top_p=0.6)] * 4000), gen)
    # {0, 1} holds 0.8 >= 0.6 while {0} holds 0.5 < 0.6; renormalised 0.625 / 0.375.
    assert set(tokens.tolist()) == {0, 1}
    assert (tokens == 0).float().mean().item() == pytest.approx(0.625, abs=0.03)  # ~4 sigma
    tokens, _ = sample(logits, _batch(*[SamplingParams(top_p=0.45)] * 4000), gen)
    assert set(tokens.tolist()) == {0}  # {0} alone already holds 0.5 >= 0.45


def test_top_p_nucleus_wider_than_the_first_candidates_is_exact():
    logits = -0.002 * torch.arange(1000.0)[None]  # slowly decaying: a nucleus of hundreds
    probs = logits.softmax(-1)[0]
    # By hand from the definition: keep token i while the mass before it is below 0.5.
    kept = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert kept > 256  # more than the first batch of candidates truncate() looks at
    out = truncate(logits, torch.tensor([0]), torch.tensor([0.5]), use_top_k=False, use_top_p=True)
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == list(range(kept))


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]])).expand(6000, 3)
    params = _batch(*[SamplingParams(temperature=0.5)] * 6000)
    tokens, _ = sample(logits, params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    # Probabilities 1:4:25 over 30; tolerance ~4 sigma of the largest binomial std (0.0048).
    assert torch.allclose(freq, torch.tensor([1 / 30, 4 / 30, 25 / 30]), atol=0.02)


def test_inverse_cdf_draws_only_weighted_tokens_in_proportion():
    weights = torch.zeros(4000, 1000)  # 1000 is not a multiple of the 256-token block
    weights[:, 5], weights[:, 700] = 1.0, 3.0  # blocks 0 and 2; block 1 and the tail are empty
    tokens = sample_from(weights, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {5, 700}
    assert (tokens == 700).float().mean().item() == pytest.approx(0.75, abs=0.03)  # ~4 sigma


def test_top_k_2_never_samples_the_third_token():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]])).expand(2000, 3)
    params = _batch(*[SamplingParams(top_k=2)] * 2000)
    tokens, _ = sample(logits, params, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    assert (tokens == 0).float().mean().item() == pytest.approx(0.4 / 0.75, abs=0.045)  # ~4 sigma


def test_mixed_batch_keeps_each_rows_parameters():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1)]
    tokens, logprobs = sample(logits, _batch(*params), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 1]
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[1].item(), abs=1e-6)
    tempered = torch.log_softmax(logits[1] / 2, -1)[1].item()
    assert logprobs[1].item() == pytest.approx(tempered, abs=1e-6)


# ---- the C sampler (bf16 logits on CPU, no truncation) -------------------------------------

needs_kernel = pytest.mark.skipif(DecodeKernels.load() is None, reason="no C compiler")


def _bf16_logits(b: int, v: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@needs_kernel
def test_kernel_sampler_draws_the_token_whose_cdf_interval_holds_u():
    logits = _bf16_logits(64, 1000, seed=0)
    temps = [0.0 if i % 4 == 0 else [0.5, 1.0, 1.7][i % 3] for i in range(64)]
    sb = _batch(*[SamplingParams(temperature=t) for t in temps])
    tokens, logprobs = sample(logits, sb, torch.Generator().manual_seed(5))
    u = torch.rand((64, 1), generator=torch.Generator().manual_seed(5))[:, 0].double()
    x = logits.double()
    for i, t in enumerate(temps):
        tok = int(tokens[i])
        if t == 0.0:  # greedy: the argmax, log-prob at temperature 1
            assert tok == int(x[i].argmax())
            expected = x[i].log_softmax(-1)[tok]
        else:
            probs = (x[i] / t).softmax(-1)
            cdf = probs.cumsum(-1)
            lo = float(cdf[tok - 1]) if tok > 0 else 0.0
            # float32 sums in another order: the interval may move by ~1e-6
            assert lo - 1e-5 <= float(u[i]) <= float(cdf[tok]) + 1e-5
            expected = (x[i] / t).log_softmax(-1)[tok]
        assert abs(float(logprobs[i]) - float(expected)) < 1e-5


@needs_kernel
def test_kernel_sampler_frequencies_follow_the_tempered_distribution():
    # 3 likely tokens among 600, at temperature 0.8: P = softmax([2, 1, 0, -inf...] / 0.8)
    row = torch.full((600,), -30.0)
    row[[7, 300, 599]] = torch.tensor([2.0, 1.0, 0.0])
    n = 20000
    logits = row.bfloat16().expand(n, -1)
    tokens, logprobs = sample(logits, _batch(*[SamplingParams(temperature=0.8)] * n),
                              torch.Generator().manual_seed(1))
    p = torch.softmax(row.double() / 0.8, -1)
    counts = torch.bincount(tokens, minlength=600).double()
    for tok in (7, 300, 599):
        expected = n * float(p[tok])
        assert abs(float(counts[tok]) - expected) < 5 * math.sqrt(expected)  # 5 sigma
        assert torch.allclose(logprobs[tokens == tok].double(), p[tok].log(), atol=1e-5)
    assert counts.sum() - counts[[7, 300, 599]].sum() <= 2  # the rest has mass ~1e-16


@needs_kernel
def test_kernel_sampler_agrees_with_the_torch_path_on_the_same_stream():
    logits = _bf16_logits(32, 4000, seed=2, scale=2.0)
    sb = _batch(*[SamplingParams(temperature=1.0)] * 32)
    fast = sample(logits, sb, torch.Generator().manual_seed(9))
    slow = sample(logits.float(), sb, torch.Generator().manual_seed(9))  # fp32: torch path
    assert (fast[0] == slow[0]).sum() >= 31  # a draw at a CDF boundary may round either way
    same = fast[0] == slow[0]
    torch.testing.assert_close(fast[1][same], slow[1][same], atol=1e-5, rtol=0)


def test_stop_checker_sees_stop_ids_eos_and_stop_strings():
    text = {5: "a", 6: "b", 7: "c"}
    checker = StopChecker(SamplingParams(stop_token_ids=[9], stop=["bc"]), eos_ids=[2],
                          decode=lambda ids: "".join(text.get(i, "?") for i in ids))
    assert checker.is_stop([5, 9]) and checker.is_stop([5, 2])
    assert not checker.is_stop([5, 6])
    assert checker.is_stop([5, 6, 7])  # the token completing "bc"


def test_ignore_eos_keeps_going_past_eos_but_not_past_stop_ids():
    checker = StopChecker(SamplingParams(stop_token_ids=[9], ignore_eos=True), eos_ids=[2])
    assert not checker.is_stop([5, 2])
    assert checker.is_stop([5, 9])


# ---- the engine on a tiny model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny) -> LocalEngine:
    config = LocalEngineConfig(dtype="float32", max_batch_size=4, max_seq_len=128)
    return LocalEngine(tiny, config, seed=0)


def run(engine: LocalEngine, *reqs: GenerationRequest):
    """Drive the engine by hand until every request is answered."""
    out: dict[str, object] = {}
    for r in reqs:
        engine.submit(r, lambda resp, rid=r.rid: out.__setitem__(rid, resp))
    while len(out) < len(reqs):
        engine.step()
    return [out[r.rid] for r in reqs]


def greedy(ids: list[int], n: int, **kw) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, **kw)
    return GenerationRequest(input_ids=ids, sampling=params)


PROMPT = [40, 41, 42, 43, 44]


def test_generation_stops_at_max_new_tokens(engine):
    (resp,) = run(engine, greedy(PROMPT, 7))
    assert len(resp.output_ids) == 7 and resp.stop_reason == StopReason.LENGTH
    assert len(resp.output_logprobs) == 7 and resp.output_versions == [0] * 7


def test_stop_token_ends_generation_and_is_kept(engine):
    (ref,) = run(engine, greedy(PROMPT, 20))
    stop_id = ref.output_ids[4]
    first = ref.output_ids.index(stop_id)
    (resp,) = run(engine, greedy(PROMPT, 20, stop_token_ids=[stop_id]))
    assert resp.output_ids == ref.output_ids[:first + 1]
    assert resp.stop_reason == StopReason.STOP


def test_stop_string_ends_on_the_token_that_completes_it(engine):
    # This prompt's greedy continuation under the tiny model holds ASCII text (most of a
    # random byte-level model's output decodes to replacement characters).
    prompt = engine.tokenizer("Hi!")["input_ids"]
    (ref,) = run(engine, greedy(prompt, 20))
    decode = engine.tokenizer.decode
    text = decode(ref.output_ids)
    stop = next(text[i:i + 3] for i in range(1, len(text) - 2)
                if all(32 < ord(c) < 127 for c in text[i:i + 3]))
    # Independently: the first prefix whose full decoded text contains the stop string.
    end = next(i for i in range(1, 21) if stop in decode(ref.output_ids[:i]))
    (resp,) = run(engine, greedy(prompt, 20, stop=[stop]))
    assert 3 <= end < 20 and resp.output_ids == ref.output_ids[:end]
    assert resp.stop_reason == StopReason.STOP


def test_eos_ids_come_from_tokenizer_and_generation_config(engine):
    assert engine.eos_ids == [engine.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_greedy_equals_hf_generate(engine, hf):
    prompts = [PROMPT, [100, 7, 250], [33] * 12]
    ours = run(engine, *(greedy(p, 16) for p in prompts))
    for p, resp in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16)[0, len(p):]
        assert resp.output_ids == ref.tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 8, 0.9)])
def test_sampled_logprobs_equal_hf_log_softmax_over_temperature(engine, hf, temperature, top_k,
                                                                top_p):
    req = GenerationRequest(input_ids=PROMPT, sampling=SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24))
    (resp,) = run(engine, req)
    ids = PROMPT + resp.output_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1]
    sampled = torch.tensor(resp.output_ids)[:, None]
    ref = (logits / temperature).log_softmax(-1).gather(-1, sampled)[:, 0]
    assert torch.allclose(torch.tensor(resp.output_logprobs), ref, atol=FP32_TOL)


# ---- per-request seeds ------------------------------------------------------------------------

def test_seeded_uniform_is_a_pure_uniform_function_of_seed_and_draw():
    from asyncrl.inference.server.sampling import seeded_uniform

    seeds = torch.tensor([3, 2**62 + 5, 0, 3], dtype=torch.long)
    counters = torch.tensor([0, 7, 0, 1], dtype=torch.long)
    u = seeded_uniform(seeds, counters)
    assert torch.equal(u, seeded_uniform(seeds, counters))  # no hidden state
    assert u[0] != u[3] and u[0] == seeded_uniform(seeds[:1], counters[:1])[0]
    # 2**16 draws of one stream, and the first draw of 2**16 streams: each fills 16 equal
    # bins with 4096 +- 64 (chi-square, 15 degrees of freedom: 99.9% below 37.7), and
    # neighbouring draws are uncorrelated (|r| < 4 / sqrt(n) = 0.016).
    n = 1 << 16
    for s, c in ((torch.full((n,), 12345, dtype=torch.long), torch.arange(n)),
                 (torch.arange(n) * 7919, torch.zeros(n, dtype=torch.long))):
        u = seeded_uniform(s, c)
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        counts = torch.bincount((u * 16).long(), minlength=16).double()
        assert float(((counts - n / 16) ** 2 / (n / 16)).sum()) < 37.7
        r = torch.corrcoef(torch.stack([u[:-1], u[1:]]).double())[0, 1]
        assert abs(float(r)) < 0.016


def test_a_seeded_row_samples_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    counters = torch.tensor([5, 0, 0, 0, 0, 0])
    rows = [SamplingParams(temperature=1.0)] * 5
    alone, lp_alone = sample(logits[:1], _batch(seeded), counters=counters[:1])
    # the same row, last in a batch of other rows drawing from a generator
    order = [1, 2, 3, 4, 5, 0]
    batch, lp_batch = sample(logits[order], _batch(*rows, seeded), torch.Generator().manual_seed(9),
                             counters=counters[order])
    assert batch[-1] == alone[0] and lp_batch[-1] == lp_alone[0]
    # the same row, its draw number changed: a different uniform number (same token only
    # by chance); 64 draws cover several tokens
    draws = {int(sample(logits[:1], _batch(seeded), counters=torch.tensor([k]))[0][0])
             for k in range(64)}
    assert len(draws) > 10


def test_seeded_draws_follow_the_distribution():
    # one row of known probabilities, 4000 seeded streams: frequencies within 4 sigma
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=1000 + i) for i in range(n)]
    tokens, _ = sample(probs.log().repeat(n, 1), _batch(*params),
                       counters=torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert bool(((freq - probs.double()).abs() < 4 * sigma).all()), freq


def test_seeded_rows_need_their_draw_numbers():
    with pytest.raises(ValueError, match="draw counters"):
        sample(torch.randn(1, 10), _batch(SamplingParams(seed=1)))
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=-1)


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # found by fuzzing the proxy: T = 1e-228 made logits / T overflow to nan, and the failed
    # step failed every request in flight. Below 1e-5 (vLLM's bound) a row is greedy.
    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1e-228), SamplingParams(temperature=9.9e-6)]
    tokens, logprobs = sample(logits, _batch(*params), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 0] and bool(torch.isfinite(logprobs).all())
    assert not SamplingParams(temperature=1e-5).greedy


def test_vllm_and_sglang_get_the_seed_and_a_new_stream_for_each_continuation():
    from asyncrl.api.types import mix_seed, piece_seed
    from asyncrl.inference.client.sglang import generate_body
    from asyncrl.inference.client.vllm import completion_body

    req = GenerationRequest(input_ids=[1, 2], sampling=SamplingParams(seed=5, max_new_tokens=8))
    assert completion_body(req, [])["seed"] == 5
    assert completion_body(req, [7, 8])["seed"] == piece_seed(5, 2) == mix_seed(5, 2) != 5
    assert generate_body(req, [7])["sampling_params"]["sampling_seed"] == mix_seed(5, 1)
    plain = GenerationRequest(input_ids=[1], sampling=SamplingParams())
    assert "seed" not in completion_body(plain, [])
    assert "sampling_seed" not in generate_body(plain, [])["sampling_params"]
