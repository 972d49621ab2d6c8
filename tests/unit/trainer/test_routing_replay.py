"""Routing replay end to end: the local engine records each token's experts, the trajectory
carries them, and the trainer's forward routes by them even where its own routers differ."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.algorithms import compute_advantages, make_ppo_loss_fn
from asyncrl.api.types import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config.algorithm import NormConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import ActorConfig, LocalEngineConfig, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine

pytestmark = pytest.mark.usefixtures("process_group")
FP32_TOL = 1e-4  # engine vs HF log-probs, as the engine's parity tests
PROMPT = [7, 30, 41, 9, 12, 80, 5]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe")


@pytest.fixture(scope="module")
def perturbed_path(moe_path, tmp_path_factory):
    """The same model with every router's weights moved: its own top k differs."""
    path = tmp_path_factory.mktemp("moe") / "perturbed"
    shutil.copytree(moe_path, path, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = t + 0.5 * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def rollout(moe_path) -> Batch:
    """A group of two sampled completions of one prompt by the engine, rewards 1 and 0."""
    engine = LocalEngine(moe_path, LocalEngineConfig(dtype="float32", max_batch_size=2,
                                                     max_seq_len=64), seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    reqs = [GenerationRequest(input_ids=PROMPT, sampling=params) for _ in range(2)]
    out: dict = {}
    for r in reqs:
        engine.submit(r, lambda resp, rid=r.rid: out.__setitem__(rid, resp))
    while len(out) < 2:
        engine.step()
    return Batch([Trajectory.from_response(out[r.rid], reward=reward, group_id="g")
                  for r, reward in zip(reqs, (1.0, 0.0))])


def make_engine(path, **overrides) -> FSDPTrainEngine:
    spec = TrainEngineSpec(path=path, dtype="float32", optimizer=OptimizerConfig(lr=1e-3),
                           **overrides)
    engine = FSDPTrainEngine(spec, total_steps=4)
    engine.initialize()
    return engine


def experts_used(engine: FSDPTrainEngine, batch) -> torch.Tensor:
    """The experts each MoE layer's experts module was handed in a forward over `batch`:
    [B, T, layers, top_k] (hooked on HF's experts modules, not on our router code)."""
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda module, args: seen.append(args[1].detach().clone()))
        for layer in engine.model.hf.model.layers]
    engine.compute_logprobs(batch)
    for h in hooks:
        h.remove()
    b, t = batch.input_ids.shape
    return torch.stack(seen, dim=1).view(b, t, len(seen), -1)


def test_the_trajectory_carries_prompt_and_completion_routes_into_the_batch(rollout):
    tb = rollout.to_tensors()
    assert tb.routed_experts.shape == (2, len(PROMPT) + 10, 2, 2)
    assert tb.routed_experts.dtype == torch.int16
    assert (tb.routed_experts[:, :-1] >= 0).all()  # every token run by the engine
    assert (tb.routed_experts[:, -1] == -1).all()  # the last, sampled but never run
    # the prompt, prefilled once per request by the same weights, was routed the same
    assert torch.equal(tb.routed_experts[0, :len(PROMPT)], tb.routed_experts[1, :len(PROMPT)])


def test_replay_uses_the_rollouts_experts_where_the_trainers_routers_would_not(
        rollout, perturbed_path):
    tb = rollout.to_tensors()
    recorded = tb.routed_experts.long()
    rows = (recorded >= 0).all(-1) & tb.attention_mask[:, :, None]  # [B, T, layers]

    own = make_engine(perturbed_path)
    differ = experts_used(own, tb).sort(-1).values != recorded.sort(-1).values
    n_differ = int((differ.any(-1) & rows).sum())
    own.destroy()
    assert n_differ > 0  # the perturbed routers choose otherwise for some tokens and layers

    replay = make_engine(perturbed_path, routing_replay=True)
    used = experts_used(replay, tb)
    assert torch.equal(used[rows], recorded[rows])  # token for token, layer for layer
    replay.destroy()


def test_replay_at_the_rollouts_weights_reproduces_the_behaviour_logprobs(rollout, moe_path):
    tb = rollout.to_tensors()
    engine = make_engine(moe_path, routing_replay=True)
    ours = engine.compute_logprobs(tb)
    engine.destroy()
    mask = tb.loss_mask > 0
    torch.testing.assert_close(ours[mask], tb.behavior_logprobs[mask], atol=FP32_TOL, rtol=0)


def test_a_grpo_step_with_replay_raises_the_rewarded_completion(rollout, perturbed_path):
    """One GRPO step (decoupled PPO loss, group-normalised rewards 1 and 0) on the perturbed
    model with replay: the loss is finite, the routers are trained (through the softmax
    weights of the replayed experts), and under the replayed routing the rewarded
    completion's log-likelihood rises and the other's falls."""
    cfg = ActorConfig(path=perturbed_path, dtype="float32", routing_replay=True,
                      optimizer=OptimizerConfig(lr=1e-3), reward_norm=NormConfig(group_size=2))
    engine = FSDPTrainEngine(TrainEngineSpec.of(cfg), total_steps=4)
    engine.initialize()
    tb = rollout.to_tensors()
    tb.advantages = compute_advantages(tb, cfg)
    assert tb.advantages[0][tb.loss_mask[0] > 0].min() > 0 > tb.advantages[1].min()
    tb.prox_logprobs = before = engine.compute_logprobs(tb)
    routers = {n: p.clone() for n, p in engine.hf_state_dict().items() if "mlp.gate." in n}
    stats = engine.train_batch(tb, make_ppo_loss_fn(cfg))
    after = engine.compute_logprobs(tb)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    trained = engine.hf_state_dict()
    assert all(not torch.equal(routers[n], trained[n]) for n in routers)
    gain = ((after - before) * tb.loss_mask).sum(-1)
    assert gain[0] > 0 > gain[1]
    engine.destroy()


def test_the_trainers_published_weights_serve_its_own_logprobs(moe_path, rollout):
    """After a step, the trainer's weights under their in-memory names (stacked experts)
    load into the engine, whose next rollout's log-probs are the trainer's (fp32)."""
    engine = make_engine(moe_path)
    engine.train_batch(rollout.to_tensors(), lambda lp, mb, *, n_tokens, n_seqs: (
        -(lp * mb.loss_mask).sum() / n_tokens, {}))
    weights = engine.hf_state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in weights)
    server = LocalEngine(moe_path, LocalEngineConfig(dtype="float32", max_batch_size=1,
                                                     max_seq_len=64), seed=1)
    server.load_weights(weights.items(), version=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    req = GenerationRequest(input_ids=PROMPT, sampling=params)
    out: dict = {}
    server.submit(req, lambda resp: out.__setitem__(req.rid, resp))
    while not out:
        server.step()
    tb = Batch([Trajectory.from_response(out[req.rid], reward=0.0, group_id="g")]).to_tensors()
    assert (tb.versions[tb.loss_mask > 0] == 1).all()
    ours = engine.compute_logprobs(tb)
    mask = tb.loss_mask > 0
    torch.testing.assert_close(ours[mask], tb.behavior_logprobs[mask], atol=FP32_TOL, rtol=0)
    engine.destroy()
