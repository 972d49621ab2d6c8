"""Trainer and inference server together: log-prob parity and interruptible weight sync.

A real server process (started by the local scheduler) and a real FSDP train engine, both
in float32 on a tiny random model: the log-probs the server records for sampled tokens must
equal the trainer's recomputation, and a weight update published while a long generation
runs must split that generation into tokens of two versions, each with the log-probs of
the weights that produced it.
"""

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.api import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config import LocalEngineConfig, load_config
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client import LocalServerClient
from asyncrl.launch import LocalScheduler
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.weights import WeightPublisher

pytestmark = pytest.mark.integration

# fp32 on both sides; the same maths in a different op order (our decoder vs HF's)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    model = make_tiny_model(root / "model", seed=3)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=8, max_seq_len=2048)
    sched_cfg = SchedulerConfig(inference_threads=1, trainer_threads=1)
    with LocalScheduler(sched_cfg, root / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(model, engine_cfg, n_servers=1, seed=0)
        client = LocalServerClient(addresses, request_timeout=120)
        cfg = load_config(None, ["train_dataset.path=x", f"actor.path={model}",
                                 "actor.dtype=float32", "actor.optimizer.lr=0.05"])
        actor = FSDPTrainEngine(TrainEngineSpec.of(cfg.actor), total_steps=10, seed=0)
        actor.initialize()
        try:
            yield model, client, actor, root
        finally:
            actor.destroy()
            asyncio.run(client.close())


def _trajectory(resp) -> Trajectory:
    return Trajectory.from_response(resp, reward=0.0, group_id="g")


def test_engine_logprobs_match_the_trainers_recomputation(setup):
    model, client, actor, _ = setup
    prompts = [[1, 60 + i, 61, 62, 63] for i in range(4)]

    async def sample():
        params = SamplingParams(temperature=1.0, max_new_tokens=24)
        return await asyncio.gather(*(client.agenerate(
            GenerationRequest(input_ids=p, sampling=params)) for p in prompts))

    responses = asyncio.run(sample())
    tb = Batch([_trajectory(r) for r in responses]).to_tensors()
    recomputed = actor.compute_logprobs(tb)
    mask = tb.loss_mask.bool()
    assert mask.sum() >= 4  # at least one sampled token per sequence
    diff = (recomputed[mask] - tb.behavior_logprobs[mask]).abs().max().item()
    assert diff < LOGPROB_TOL, f"engine vs trainer log-prob gap {diff:.2e}"


def test_update_mid_generation_gives_two_versions_each_with_its_own_logprobs(setup):
    model, client, actor, root = setup
    prompt = [1, 70, 71, 72]
    publisher = WeightPublisher(root / "weights", client, dtype="float32")
    result = {}

    def generate():
        params = SamplingParams(temperature=1.0, max_new_tokens=2000, ignore_eos=True)
        result["resp"] = asyncio.run(client.agenerate(GenerationRequest(input_ids=prompt,
                                                                          sampling=params)))

    # one training step so that version 1 differs from version 0
    warmup = asyncio.run(client.agenerate(GenerationRequest(
        input_ids=prompt, sampling=SamplingParams(temperature=1.0, max_new_tokens=8))))
    tb = Batch([_trajectory(warmup)]).to_tensors()

    def loss_fn(logprobs, mb, *, n_tokens, n_seqs):
        return -(logprobs * mb.loss_mask).sum() / n_tokens, {}

    actor.train_batch(tb, loss_fn)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while asyncio.run(client.health())[0]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # publish only once the generation is under way
    publisher.publish(actor, version=1)
    thread.join(120)
    resp = result["resp"]
    versions = resp.output_versions
    assert 0 in versions and 1 in versions, "the update did not land mid-generation"
    first_new = versions.index(1)
    assert versions == [0] * first_new + [1] * (len(versions) - first_new)

    traj = _trajectory(resp)
    tb = Batch([traj]).to_tensors()
    v1 = actor.compute_logprobs(tb)[0]
    with torch.no_grad():
        hf_v0 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        logits = hf_v0(torch.tensor([traj.input_ids])).logits[0, :-1]
        v0 = torch.cat([torch.zeros(1), logits.log_softmax(-1).gather(
            -1, torch.tensor(traj.input_ids[1:])[:, None])[:, 0]])
    behaviour = tb.behavior_logprobs[0]
    n_prompt = len(prompt)
    old = slice(n_prompt, n_prompt + first_new)
    new = slice(n_prompt + first_new, len(traj.input_ids))
    assert (behaviour[old] - v0[old]).abs().max() < LOGPROB_TOL
    assert (behaviour[new] - v1[new]).abs().max() < LOGPROB_TOL
    # and the two versions really differ on the new tokens
    assert (v1[new] - v0[new]).abs().max() > 100 * LOGPROB_TOL
