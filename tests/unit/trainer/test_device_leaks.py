"""The torch paths that run on a GPU keep every tensor on the device of their inputs.

Each path runs on the simulated accelerator of `device_check.py` (tensors reporting `meta`,
holding CPU data), where a tensor made without `device=` is a CPU tensor and an op that
meets it raises `DeviceLeak`, as CUDA would. The C kernels are the CPU's; on the device
every path takes the torch branch a GPU takes. The numbers are then checked against the
same path run on the CPU. (The `device`-marked tests of test_on_device.py, the log-prob
head's among them, also run on the simulated accelerator.)
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from batches import random_batch
from device_check import DEVICE, DeviceLeak, host, is_on_device, simulated_device

from asyncrl.algorithms import (
    compute_advantages_and_returns,
    make_dpo_loss_fn,
    make_ppo_loss_fn,
    make_sft_loss_fn,
    make_value_loss_fn,
)
from asyncrl.algorithms.distill import with_distillation
from asyncrl.algorithms.rm import make_bradley_terry_loss_fn
from asyncrl.api.types import GenerationRequest, SamplingParams, TensorBatch
from asyncrl.config.algorithm import ActorConfig, CriticConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import LocalEngineConfig, MicroBatchSpec, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import engine as engine_module
from asyncrl.trainer.cpu import logprob_head
from asyncrl.trainer.engine import FSDPTrainEngine
from asyncrl.trainer.reward import FSDPRewardEngine
from asyncrl.trainer.value import FSDPValueEngine
from asyncrl.weights import WeightPublisher, transport
from asyncrl.weights.broadcast import WeightSender

pytestmark = pytest.mark.usefixtures("process_group")
VOCAB = 320  # the tiny model's


# ---- the harness itself ---------------------------------------------------------------------

def test_the_harness_refuses_what_cuda_refuses_and_allows_what_it_allows():
    with simulated_device() as dev:
        x = torch.arange(6.0).reshape(2, 3).to(dev)
        # CUDA takes a CPU 0-dim scalar, CPU indices of advanced indexing, and copies
        assert host(x * torch.tensor(2.0)).tolist() == [[0, 2, 4], [6, 8, 10]]
        assert host(x[torch.tensor([1])]).tolist() == [[3, 4, 5]]
        x[torch.tensor([0])] = torch.zeros(3, device=dev)
        assert x.cpu().tolist() == [[0, 0, 0], [3, 4, 5]] and float(x.sum()) == 12.0
        assert is_on_device(torch.tensor([1, 2], device=dev)) and x.new_tensor([1]).device == DEVICE
        # ...and refuses a CPU tensor anywhere else, an index_select's index included
        for leak in (lambda: x + torch.ones(3), lambda: torch.cat([x, torch.ones(1, 3)]),
                     lambda: x.index_select(0, torch.tensor([0])),
                     lambda: torch.empty(2, 3).copy_(x).mul_(x)):
            with pytest.raises(DeviceLeak, match="a CPU tensor"):
                leak()
        with pytest.raises(DeviceLeak, match="generator of the CPU"):
            torch.rand(2, device=dev, generator=torch.Generator())
        gen = torch.Generator(device=dev).manual_seed(0)
        assert is_on_device(torch.rand(2, device=dev, generator=gen))
        with pytest.raises(RuntimeError, match="numpy"):  # CUDA tensors have no numpy view
            x.numpy()
        # in inference mode `.to(device, dtype)` reaches the dispatcher as aten.to.device
        with torch.inference_mode():
            moved = torch.ones(2, 3).to(dev, torch.float16)
            assert is_on_device(moved) and moved.dtype == torch.float16
            with pytest.raises(DeviceLeak, match="a CPU tensor"):
                moved + torch.ones(3, dtype=torch.float16)
            back = moved.to("cpu", torch.float32)
            assert not is_on_device(back) and back.tolist() == [[1.0] * 3] * 2


# ---- the trainer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine_on(cls, path: str, device, **spec) -> FSDPTrainEngine:
    """An initialised engine of `cls` on `device` (one rank)."""
    spec.setdefault("optimizer", OptimizerConfig(lr=1e-3))
    spec.setdefault("dtype", "float32")
    spec.setdefault("mb_spec", MicroBatchSpec(granularity=2))  # DPO's and the RM's pairs
    engine = cls(TrainEngineSpec(path=path, **spec), total_steps=10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "local_device", lambda *args, **kwargs: torch.device(device))
        engine.initialize()
    return engine


def rl_batch() -> TensorBatch:
    """A batch carrying everything the actor's losses read, advantages as the trainer sets."""
    batch = random_batch()
    gen = torch.Generator().manual_seed(1)

    def noise() -> torch.Tensor:
        return -3 + 0.3 * torch.randn(batch.loss_mask.shape, generator=gen)

    batch.behavior_logprobs = noise() * batch.loss_mask
    batch.prox_logprobs, batch.ref_logprobs, batch.teacher_logprobs = noise(), noise(), noise()
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # also (chosen, rejected) pairs: DPO
    batch.values = torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    cfg = ActorConfig(path="x", reward_norm=None, discount=0.9, gae_lambda=0.8)
    batch.advantages, batch.returns = compute_advantages_and_returns(batch, cfg)
    return batch


ACTOR = ActorConfig(path="x", kl_ctl=0.1, use_kl_loss=True, distill_coef=0.2, max_new_tokens=16,
                    c_clip=3.0)
LOSSES = {"ppo": with_distillation(make_ppo_loss_fn(ACTOR), ACTOR),
          "ppo_prox_current": make_ppo_loss_fn(ACTOR, prox_is_current=True),
          "sft": make_sft_loss_fn(), "dpo": make_dpo_loss_fn(beta=0.1)}


def train_run(path: str, device, spec: dict, batch) -> list:
    """Log-probs, then a step per loss function: the outputs a test compares. (Adam with
    eps = 1 moves a weight by ~lr * grad: a weight whose gradient is ~0 moves ~0, not
    ~lr in the direction of its rounding.)"""
    engine = engine_on(FSDPTrainEngine, path, device,
                       optimizer=OptimizerConfig(lr=1e-2, eps=1.0), **spec)
    out = [engine.compute_logprobs(batch)]
    for name, loss_fn in LOSSES.items():
        stats = engine.train_batch(batch, loss_fn)
        out.append((name, stats["loss"], stats["grad_norm"]))
    out.append(engine.hf_state_dict())
    engine.destroy()
    return out


@pytest.mark.filterwarnings("ignore:.*non-meta parameter")
@pytest.mark.parametrize("spec", [
    {}, {"shared_prefix": True}, {"dtype": "bfloat16"},
    {"dtype": "bfloat16", "shared_prefix": True, "gradient_checkpointing": True},
    {"mb_spec": MicroBatchSpec(max_tokens_per_mb=24, granularity=2)}],
    ids=["fp32", "shared_prefix", "bf16", "bf16_shared_prefix_checkpointing", "micro_batches"])
def test_a_train_step_stays_on_the_device_and_computes_the_cpus_numbers(
        tiny_model, monkeypatch, spec):
    # The budget keeps 3 rows' templates: the rest of each micro-batch recomputes its
    # chunks in backward (the first GPU step of every example crashed there).
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * VOCAB)
    monkeypatch.setattr(logprob_head, "SAVED_TEMPLATE_BYTES", 3 * VOCAB * 2)
    batch = rl_batch()
    with simulated_device() as dev:
        ours = train_run(tiny_model, dev, spec, batch)
    ref = train_run(tiny_model, "cpu", spec, batch)
    bf16 = spec.get("dtype") == "bfloat16"
    torch.testing.assert_close(ours[0], ref[0], **({"atol": 0.05, "rtol": 0} if bf16 else {}))
    for (name, loss, norm), (_, ref_loss, ref_norm) in zip(ours[1:-1], ref[1:-1]):
        assert loss == pytest.approx(ref_loss, rel=0.02 if bf16 else 1e-5, abs=1e-6), name
        assert norm == pytest.approx(ref_norm, rel=0.05 if bf16 else 1e-4), name
    for name, value in ours[-1].items():
        assert value.device.type == "cpu"  # what a publish writes
        torch.testing.assert_close(value, ref[-1][name], atol=1e-3 if bf16 else 1e-5, rtol=0)


def test_the_critic_and_the_reward_model_stay_on_the_device(tiny_model):
    batch = rl_batch()
    value_loss = make_value_loss_fn(CriticConfig(eps_clip=0.2))
    pairs = dataclasses.replace(random_batch(lengths=(9, 7, 6, 8)),
                                rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    results = []
    for place in (simulated_device(), contextlib.nullcontext(torch.device("cpu"))):
        with place as dev:
            critic = engine_on(FSDPValueEngine, tiny_model, dev, shared_prefix=True)
            values = critic.compute_values(batch)
            critic_stats = critic.train_batch(batch, value_loss)
            critic.destroy()
            rm = engine_on(FSDPRewardEngine, tiny_model, dev)
            scores = rm.compute_outputs(pairs)
            rm_stats = rm.train_batch(pairs, make_bradley_terry_loss_fn())
            rm.destroy()
        results.append((values, critic_stats, scores, rm_stats))
    (values, critic_stats, scores, rm_stats), ref = results
    assert values.device.type == scores.device.type == "cpu"
    torch.testing.assert_close(values, ref[0])
    torch.testing.assert_close(scores, ref[2])
    for stats, ref_stats in ((critic_stats, ref[1]), (rm_stats, ref[3])):
        assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-4)


# ---- checkpoints and the weight export ------------------------------------------------------

class _Wire:
    """A weight-update group whose broadcast keeps a copy of each bucket."""

    def __init__(self) -> None:
        self.buckets: list[torch.Tensor] = []

    def send(self, layout, tensors, buffers, timeout: float) -> None:
        def start(group, bucket: torch.Tensor, timeout: float):
            self.buckets.append(bucket.clone())
            return lambda: None

        transport.send_buckets(None, layout, tensors, buffers, timeout, start=start)

    def close(self) -> None:
        pass


def broadcast(actor: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    """What a broadcast of `actor`'s weights (bf16, small buckets) delivers, by name."""
    sender, wire, layouts = WeightSender(0), _Wire(), []
    sender.adopt(wire)
    sender.send(actor, bucket_bytes=1 << 16, on_layout=layouts.append)
    return {name: t.clone() for b, data in enumerate(wire.buckets)
            for name, t in layouts[0].unpack(b, data)}


@pytest.mark.filterwarnings("ignore:.*non-meta parameter")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_state_round_trips_and_weights_export_from_the_device(tiny_model, tmp_path,
                                                                     dtype):
    from safetensors.torch import load_file

    batch, loss_fn = rl_batch(), LOSSES["sft"]
    with simulated_device() as dev:
        first = engine_on(FSDPTrainEngine, tiny_model, dev, dtype=dtype)
        first.train_batch(batch, loss_fn)
        first.save_state(tmp_path / "state")
        masters = first.hf_state_dict()
        # Publishing: by disk (the bf16 copies of one rank: fresh after a forward, stale
        # after a step) and by broadcast (the gathered bucket layout).
        publisher = WeightPublisher(tmp_path / "weights", engine=None)
        publisher.save(first, 1)
        first.compute_logprobs(batch)
        publisher.save(first, 2)
        sent = broadcast(first)
        second = engine_on(FSDPTrainEngine, tiny_model, dev, dtype=dtype)
        second.load_state(tmp_path / "state")
        assert second.steps_done == 1
        for name, value in second.hf_state_dict().items():
            assert torch.equal(value, masters[name]), name
        after = [e.train_batch(random_batch(seed=3), loss_fn)["loss"] for e in (first, second)]
    assert after[0] == after[1]  # the optimiser's state came back too
    for version in (1, 2):
        files = load_file(publisher.path(version) / "model.safetensors")
        assert files.keys() == masters.keys()
        for name, value in files.items():
            assert torch.equal(value, masters[name].to(torch.bfloat16)), (version, name)
    assert all(torch.equal(sent[n], masters[n].to(torch.bfloat16)) for n in masters)


# ---- the local engine -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> tuple[str, str]:
    """A Qwen3 (q/k norms) and a second version of it: an update's weights."""
    root = tmp_path_factory.mktemp("qwen3")
    return (make_tiny_model(root / "v0", arch="qwen3", seed=0),
            make_tiny_model(root / "v1", arch="qwen3", seed=1))


def generate_all(path: str, update: str, device, dtype: str) -> dict[str, tuple]:
    """Greedy, sampled, top-k/top-p and seeded requests, one admitted mid-decode, a weight
    update mid-generation (its KV recomputed): tokens, log-probs and versions of each."""
    engine = LocalEngine(path, LocalEngineConfig(dtype=dtype, max_batch_size=3, max_seq_len=64),
                         device=device)
    params = {"greedy": SamplingParams(temperature=0.0, max_new_tokens=6),
              "sampled": SamplingParams(temperature=0.8, max_new_tokens=9),
              "truncated": SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=4,
                                          seed=7),
              "late": SamplingParams(temperature=0.0, max_new_tokens=5, seed=3)}
    prompts = {"greedy": [10, 11, 12], "sampled": [5, 6, 7, 8, 9], "truncated": [20, 21],
               "late": [10, 11, 12, 40]}
    out: dict = {}

    def submit(name: str) -> None:
        req = GenerationRequest(input_ids=prompts[name], sampling=params[name])
        engine.submit(req, lambda resp: out.__setitem__(name, resp))

    for name in ("greedy", "sampled", "truncated"):
        submit(name)
    engine.step()
    engine.step()
    engine.update_weights(update, version=1)
    engine.step()
    submit("late")  # waits for a slot: admitted once "truncated" has finished
    while len(out) < 4:
        engine.step()
    digest = engine.weights_digest()
    return {k: (r.output_ids, r.output_logprobs, r.output_versions) for k, r in out.items()} | {
        "digest": digest["sha256"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_local_engines_torch_path_stays_on_the_device(tiny_qwen3, dtype):
    with simulated_device() as dev:
        ours = generate_all(*tiny_qwen3, dev, dtype)
    # The CPU takes the same torch path in fp32 (its C forward is bf16's): the same tokens.
    if dtype == "float32":
        assert ours == generate_all(*tiny_qwen3, "cpu", dtype)
    assert ours["late"][2] == [1] * 5 and 0 in ours["sampled"][2] and 1 in ours["sampled"][2]
