"""Top-k log-probs and echo on our engine's OpenAI routes, against an HF forward's
log-softmax on the same tiny model (fp32)."""

from __future__ import annotations

import openai
import pytest
import torch
from serving import serving
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.local_backend import LocalBackend
from asyncrl.models.tiny import make_tiny_model
from asyncrl.openai.detokenize import token_bytes, token_string
from asyncrl.openai.routes import openai_app

torch.set_num_threads(1)
MODEL = "tiny"
FP32_TOL = 1e-4  # our fp32 forward vs HF's, as the engine's logprob tests allow
PROMPT = [70, 71, 72, 73, 74, 75]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=3)
    engine = LocalEngine(path, LocalEngineConfig(dtype="float32", max_batch_size=4,
                                                 max_seq_len=128))
    engine.start()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with serving(openai_app(LocalBackend(engine), engine.tokenizer, MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), hf, engine
    engine.close()


def hf_logprobs(hf, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) after each prefix of `ids`: row i predicts ids[i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return (logits / temperature).log_softmax(-1)


def name(engine, token_id: int) -> str:
    return token_string(token_bytes(engine.tokenizer, token_id))


def assert_top_k(got: dict[str, float], row: torch.Tensor, k: int, engine) -> None:
    values, ids = row.topk(k)
    want = {name(engine, i): v for i, v in zip(ids.tolist(), values.tolist())}
    for token, lp in want.items():
        assert got[token] == pytest.approx(lp, abs=FP32_TOL), token


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_completion_top_logprobs_are_hfs_top_k_and_hold_the_sampled_token(served, temperature):
    client, hf, engine = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3,
                                    temperature=temperature, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    output = choice.model_extra["token_ids"]
    ref = hf_logprobs(hf, PROMPT + output, temperature or 1.0)[len(PROMPT) - 1:-1]
    lp = choice.logprobs
    assert len(lp.top_logprobs) == len(output) == 5
    for i, token_id in enumerate(output):
        top = lp.top_logprobs[i]
        assert_top_k(top, ref[i], 3, engine)
        sampled = name(engine, token_id)
        # the sampled token's entry is its own log-prob (vLLM adds it when not in the top k)
        assert top[sampled] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert lp.token_logprobs[i] == pytest.approx(ref[i, token_id].item(), abs=FP32_TOL)
        assert len(top) in (3, 4) and (len(top) == 3) == (sampled in list(top)[:3])


def test_chat_top_logprobs_list_the_k_most_likely_tokens_in_order(served):
    client, hf, engine = served
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4,
        logprobs=True, top_logprobs=4, temperature=1.0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    prompt, output = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    ref = hf_logprobs(hf, prompt + output)[len(prompt) - 1:-1]
    for i, entry in enumerate(choice.logprobs.content):
        values, ids = ref[i].topk(4)
        assert [a.token for a in entry.top_logprobs] == [name(engine, t) for t in ids.tolist()]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(),
                                                                       abs=FP32_TOL)
        assert entry.top_logprobs[0].bytes == list(token_bytes(engine.tokenizer,
                                                               ids[0].item()))
        assert entry.logprob == pytest.approx(ref[i, output[i]].item(), abs=FP32_TOL)


def test_echo_with_no_tokens_gives_the_prompts_log_probs(served):
    client, hf, engine = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=2)
    choice = out.choices[0]
    ref = hf_logprobs(hf, PROMPT)
    lp = choice.logprobs
    assert lp.tokens == [name(engine, t) for t in PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=FP32_TOL)
    for i in range(1, len(PROMPT)):
        assert_top_k(lp.top_logprobs[i], ref[i - 1], 2, engine)
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
    assert choice.text == engine.tokenizer.decode(PROMPT)
    assert lp.text_offset[0] == 0 and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 0)


def test_echo_puts_the_prompt_before_the_completion(served):
    client, hf, engine = served
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                    logprobs=0, temperature=0.0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    output = choice.model_extra["token_ids"]
    ref = hf_logprobs(hf, PROMPT + output)
    ids = PROMPT + output
    assert choice.logprobs.tokens == [name(engine, t) for t in ids]
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=FP32_TOL)
    assert choice.logprobs.top_logprobs is None
    prompt_text = engine.tokenizer.decode(PROMPT)
    assert choice.text.startswith(prompt_text)
    assert choice.logprobs.text_offset[len(PROMPT)] == len(prompt_text)


@pytest.mark.parametrize("kwargs, param, message", [
    ({"max_tokens": 0}, "max_tokens", "it is for echo: true"),
    ({"logprobs": 2, "stream": True}, "logprobs", "non-streamed only"),
    ({"echo": True, "stream": True}, "echo", "non-streamed only"),
    ({"logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20]"),
])
def test_requests_it_cannot_answer_are_400_naming_the_field(served, kwargs, param, message):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert err.value.body["param"] == param and message in err.value.message


def test_chat_top_logprobs_needs_logprobs(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs" and "needs logprobs: true" in \
        err.value.message


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bf16_sampled_log_probs_equal_their_top_k_entries(tmp_path, temperature):
    """The C sampler's log-prob of each token (bf16 on the CPU) and the top-k list, computed
    apart, agree wherever the sampled token is among the top k."""
    from asyncrl.api.types import GenerationRequest, SamplingParams

    path = make_tiny_model(tmp_path / "tiny", seed=4)
    engine = LocalEngine(path, LocalEngineConfig(dtype="bfloat16", max_batch_size=2,
                                                 max_seq_len=64))
    engine.start()
    try:
        resp = engine.generate(GenerationRequest(input_ids=PROMPT, sampling=SamplingParams(
            max_new_tokens=12, temperature=temperature, ignore_eos=True, top_logprobs=8)))
    finally:
        engine.close()
    found = 0
    for token, lp, top in zip(resp.output_ids, resp.output_logprobs, resp.output_top_logprobs):
        assert len(top) == 8 and list(top.values()) == sorted(top.values(), reverse=True)
        if token in top:
            found += 1
            assert top[token] == pytest.approx(lp, abs=1e-5)
    assert found >= (12 if temperature == 0.0 else 4)
