"""Token streaming out of a hand-driven LocalEngine, through the asyncio backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.api.types import GenerationRequest, GenerationResponse, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.local_backend import LocalBackend
from asyncrl.models.tiny import make_tiny_model
from asyncrl.openai.routes import StreamedToken

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LocalEngine:
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return LocalEngine(path, LocalEngineConfig(dtype="float32", max_batch_size=2, max_seq_len=64))


def _request(n: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return GenerationRequest(input_ids=[70, 71, 72], sampling=params)


def test_each_token_is_streamed_when_its_step_ends_before_the_response(engine):
    async def go() -> list:
        stream = LocalBackend(engine).astream(_request(3))
        got = []
        for _ in range(3):
            engine.step()  # one step: one token (the first from the prefill)
            got.append(await asyncio.wait_for(anext(stream), 5))
            assert isinstance(got[-1], StreamedToken)
        got.append(await asyncio.wait_for(anext(stream), 5))  # the response, after the last token
        return got
    *tokens, resp = asyncio.run(go())
    assert isinstance(resp, GenerationResponse)
    assert [t.id for t in tokens] == resp.output_ids
    assert [t.logprob for t in tokens] == resp.output_logprobs
    assert [t.version for t in tokens] == resp.output_versions == [0, 0, 0]


def test_a_prompt_the_engine_refuses_raises_at_submit(engine):
    async def go() -> None:
        LocalBackend(engine).astream(GenerationRequest(input_ids=[5] * 64))
    with pytest.raises(ValueError, match="max_seq_len"):
        asyncio.run(go())
