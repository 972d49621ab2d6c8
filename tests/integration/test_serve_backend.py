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
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # the vLLM server went down with the command: nothing listens on its private port
    assert proc.returncode in (0, 143, -signal.SIGTERM)
