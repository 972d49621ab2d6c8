"""The official `openai` client against a real local server (and the gateway) on a tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import openai
import pytest
from procs import read_address
from transformers import AutoTokenizer

from asyncrl.models.tiny import make_tiny_model

KEY = "sk-openai-test"
PROMPT = "Hello"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tok(model):
    return AutoTokenizer.from_pretrained(model)


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "ASYNCRL_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        return proc, read_address(proc, timeout=90)
    except RuntimeError:
        proc.kill()
        raise


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0  # a clean shutdown


@pytest.fixture(scope="module")
def server(model):
    proc, url = _start(["asyncrl.inference.server.app", "--model", model, "--port", "0",
                        "--threads", "1", "--dtype", "float32", "--max-batch-size", "4",
                        "--max-seq-len", "1024"])
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def raw_generate(server: str, input_ids: list[int], n: int) -> dict:
    """Greedy /generate of the native API, for comparison."""
    async def go() -> dict:
        body = {"input_ids": input_ids, "sampling": {"temperature": 0.0, "max_new_tokens": n}}
        async with aiohttp.ClientSession() as s, s.post(
                f"{server}/generate", json=body,
                headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
            return await r.json()
    return asyncio.run(go())


@pytest.mark.integration
def test_models_list_names_the_served_model(client, model):
    assert [m.id for m in client.models.list()] == [model]


@pytest.mark.integration
def test_completion_logprobs_and_token_ids_equal_raw_greedy_generate(client, server, model, tok):
    out = client.completions.create(model=model, prompt=PROMPT, logprobs=0, **GREEDY)
    choice = out.choices[0]
    assert choice.prompt_token_ids == tok.encode(PROMPT)
    assert tok.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    raw = raw_generate(server, choice.prompt_token_ids, len(choice.token_ids))
    assert choice.token_ids == raw["output_ids"]
    assert choice.logprobs.token_logprobs == pytest.approx(raw["output_logprobs"], abs=1e-5)
    assert choice.token_logprobs == choice.logprobs.token_logprobs
    assert choice.token_versions == [0] * len(choice.token_ids)
    assert out.usage.completion_tokens == len(choice.token_ids)


@pytest.mark.integration
def test_chat_stream_concatenates_to_the_greedy_answer(client, model):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=model, messages=messages, logprobs=True, **GREEDY)
    choice = full.choices[0]
    assert len(choice.logprobs.content) == len(choice.token_ids)
    assert [e.logprob for e in choice.logprobs.content] == choice.token_logprobs
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [t for c in chunks for t in getattr(c.choices[0], "token_ids", None) or []] == (
        choice.token_ids)
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.integration
def test_n_choices_and_max_tokens_ends_with_length(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3,
        extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in out.choices)
    assert out.usage.completion_tokens == 6


@pytest.mark.integration
def test_bad_request_and_missing_key_are_openai_errors(client, server, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, top_p=1.5)
    assert err.value.body["param"] == "top_p" and "top_p" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x" * 1100)
    assert err.value.body["code"] == "context_length_exceeded"
    anonymous = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


@pytest.mark.integration
def test_gateway_in_front_of_the_server_answers_like_the_server(client, server, model):
    proc, url = _start(["asyncrl.inference.gateway", "--backend-url", server, "--port", "0"])
    try:
        via = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        out = via.completions.create(model=model, prompt=PROMPT, **GREEDY)
        direct = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert out.choices[0].text == direct.choices[0].text
        assert out.choices[0].token_ids == direct.choices[0].token_ids
        chunks = list(via.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks) == direct.choices[0].text
    finally:
        _stop(proc)
