"""A vLLM server loaded as the quickstart loads it: more prompt tokens at once than one
scheduler step takes (vLLM's default budget is 2,048 tokens), every request with its own seed.

vLLM splits such a batch's prefills over steps unless chunked prefill is off; a split
prefill rewinds the request's random generator, which a CPU generator cannot do
(`docs/guides/reliability.md`, "Seeded sampling on each backend"). One server for the module,
started by the same code as a run's (`launch/commands.py`).
"""

import asyncio
import random

import pytest
from vllm_util import hf_logprobs, needs_vllm

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.launch import LocalScheduler
from asyncrl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm,
              pytest.mark.slow]  # ~60 s; test_vllm_backend runs a vLLM server in every suite

N_REQUESTS = 48
PROMPT_LEN = 120  # 48 x 120 = 5,760 prompt tokens: about three of vLLM's 2,048-token steps
NEW_TOKENS = 6
LOGPROB_TOL = 1e-3  # float32 on both sides (see test_vllm_backend.py)


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-load")
    model = make_tiny_model(root / "model", arch="llama", seed=3)
    sched = SchedulerConfig(inference_threads=1, trainer_threads=1, startup_timeout=300)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=64, max_seq_len=512)
    with LocalScheduler(sched, root / "logs") as scheduler:
        [address] = scheduler.launch_inference_servers(model, engine_cfg, n_servers=1, seed=0,
                                                       backend="vllm")
        client = VLLMClient([address], request_timeout=240,
                                     update_weights_timeout=60)
        try:
            yield client, model
        finally:
            asyncio.run(client.close())


def _requests(seed0: int) -> list[GenerationRequest]:
    rng = random.Random(seed0)
    return [GenerationRequest(
        input_ids=[1] + [rng.randrange(3, 250) for _ in range(PROMPT_LEN - 1)],
        sampling=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                seed=seed0 + i))
        for i in range(N_REQUESTS)]


async def _all(client, requests):
    return await asyncio.gather(*(client.agenerate(r) for r in requests))


def test_seeded_batch_larger_than_a_prefill_step_completes(loaded_server):
    client, model = loaded_server
    requests = _requests(100)
    results = asyncio.run(_all(client, requests))
    assert [len(r.output_ids) for r in results] == [NEW_TOKENS] * N_REQUESTS
    # The server kept computing the right numbers under load: two requests' log-probs
    # against HF's float32 forward of the same model.
    for i in (0, N_REQUESTS - 1):
        ref = hf_logprobs(model, requests[i].input_ids, results[i].output_ids)
        gap = max(abs(a - b) for a, b in zip(results[i].output_logprobs, ref))
        assert gap < LOGPROB_TOL, f"request {i}: vLLM vs HF log-prob gap {gap:.2e}"


def test_a_seed_gives_the_same_tokens_alone_and_in_a_loaded_batch(loaded_server):
    client, _ = loaded_server
    requests = _requests(200)
    batch = asyncio.run(_all(client, requests))
    for i in (0, 17, N_REQUESTS - 1):
        alone = asyncio.run(client.agenerate(requests[i]))
        assert alone.output_ids == batch[i].output_ids, f"request {i}"
