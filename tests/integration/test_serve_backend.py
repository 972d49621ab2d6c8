"""`asyncrl serve --backend vllm`: a vLLM server behind our OpenAI gateway, used by `openai`."""

import os
import signal
import subprocess
import sys

import openai
import pytest
from procs import read_address
from vllm_util import hf_logprobs, needs_vllm

from asyncrl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm]


@pytest.mark.slow  # 52 s; vLLM runs in CI through test_vllm_grpo.py and test_vllm_backend.py
def test_openai_client_through_the_gateway_to_a_vllm_server(tmp_path):
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "serve", "--backend", "vllm", "--model", model,
         "--port", "0", "--dtype", "float32", "--max-seq-len", "256", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = read_address(proc, timeout=400)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [model]
        out = client.completions.create(model=model, prompt="hello", max_tokens=8,
                                        temperature=1.0, logprobs=0,
                                        extra_body={"ignore_eos": True})
        choice = out.choices[0].model_dump()
        assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
        assert choice["token_versions"] == [0] * 8
        # the log-probs of the sampled tokens are the model's, computed independently by HF
        ref = hf_logprobs(model, choice["prompt_token_ids"], choice["token_ids"])
        assert max(abs(a - b) for a, b in zip(choice["token_logprobs"], ref)) < 1e-3
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason in ("stop", "length")
        # Concurrent seeded requests with more prompt tokens than one of vLLM's steps takes
        # (48 x 120 > 2,048): on a CPU a split prefill with a seed would kill its engine.
        burst = _seeded_burst(url, model, 48)
        assert [len(c["token_ids"]) for c in burst] == [4] * 48
        again = _seeded_burst(url, model, 1)  # the first request alone: same seed, same tokens
        assert again[0]["token_ids"] == burst[0]["token_ids"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # the vLLM server went down with the command: nothing listens on its private port
    assert proc.returncode in (0, 143, -signal.SIGTERM)


def _seeded_burst(url: str, model: str, n: int) -> list[dict]:
    """`n` concurrent completions of 120-token prompts, request i with seed i."""
    import asyncio
    import random

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 250) for _ in range(120)] for _ in range(48)]
        outs = await asyncio.gather(*(client.completions.create(
            model=model, prompt=prompts[i], max_tokens=4, temperature=1.0, seed=i,
            extra_body={"ignore_eos": True}) for i in range(n)))
        await client.close()
        return [o.choices[0].model_dump() for o in outs]
    return asyncio.run(run())
