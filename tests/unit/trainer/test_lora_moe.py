"""LoRA on a Mixture-of-Experts model (tiny Qwen3-MoE): "all-linear" adapts the attention
projections only (the router and the fused experts are not linear layers and take no
adapters), the adapters alone get gradients, a published adapter gives our engine the
trainer's log-probs, and a GRPO step with routing replay trains the adapters by the
gradient of a hand-written LoRA and replayed routing."""

import pytest
import torch
from torch.nn import functional as F

from asyncrl.algorithms import compute_advantages, make_ppo_loss_fn
from asyncrl.api.types import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config.algorithm import NormConfig
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import ActorConfig, LocalEngineConfig, OptimizerConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("process_group")
RANK, ALPHA = 4, 8  # scaling 2
PROMPT = [7, 30, 41, 9, 12, 80, 5]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora_moe") / "m", arch="qwen3_moe")


def actor_config(path, **overrides) -> ActorConfig:
    overrides.setdefault("optimizer", OptimizerConfig(lr=1e-2, gradient_clipping=0.0))
    overrides.setdefault("target_modules", ["all-linear"])
    return ActorConfig(path=path, dtype="float32", use_lora=True, lora_rank=RANK,
                       lora_alpha=ALPHA, **overrides)


def make_engine(path, **overrides) -> FSDPTrainEngine:
    engine = FSDPTrainEngine(TrainEngineSpec.of(actor_config(path, **overrides)),
                             total_steps=10)
    engine.initialize()
    return engine


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


def sample(path, n, *, adapter=None, seed=0) -> Batch:
    """`n` completions of PROMPT by our engine (fp32), with their routes; after loading
    `adapter` as version 1 if given. Rewards 1, 0, 1, 0, ..."""
    engine = LocalEngine(path, LocalEngineConfig(dtype="float32", max_batch_size=n,
                                                 max_seq_len=64), seed=seed)
    if adapter is not None:
        engine.update_weights(adapter, version=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    reqs = [GenerationRequest(input_ids=PROMPT, sampling=params) for _ in range(n)]
    out: dict = {}
    for r in reqs:
        engine.submit(r, lambda resp, rid=r.rid: out.__setitem__(rid, resp))
    while len(out) < n:
        engine.step()
    engine.close()
    return Batch([Trajectory.from_response(out[r.rid], reward=float(i % 2 == 0), group_id="g")
                  for i, r in enumerate(reqs)])


def randomise_lora_b(engine, seed=0) -> None:
    """PEFT starts B at 0: give it values, so A has a gradient and the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def adapters_of(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    params = dict(engine.model.named_parameters())
    return {n.removeprefix("hf.").removesuffix(".lora_A.default.weight"):
            (a.detach().clone(), params[n.replace("lora_A", "lora_B")].detach().clone())
            for n, a in params.items() if n.endswith(".lora_A.default.weight")}


def hand_logprobs(path, adapters, batch, routes=None):
    """HF's Qwen3-MoE with W x + 2 B A x written into each adapted projection and, given
    `routes` [B, T, layers, k], each router's top k replaced by them (weighted by its own
    softmax there, norm_topk_prob being false); token log-probs by a full log_softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = dict(hf.named_modules())
    for name, (a, b) in adapters.items():
        def lora_forward(x, w=modules[name].weight, a=a, b=b):
            return F.linear(x, w) + (ALPHA / RANK) * ((x @ a.T) @ b.T)

        modules[name].forward = lora_forward
    if routes is not None:
        k = routes.shape[-1]
        for j, layer in enumerate(hf.model.layers):
            def routed(x, w=layer.mlp.gate.weight, chosen=routes[:, :, j].reshape(-1, k).long()):
                logits = F.linear(x.reshape(-1, x.shape[-1]), w)
                probs = logits.softmax(-1)  # a token without a record (-1): its own top k
                chosen = torch.where(chosen >= 0, chosen, probs.topk(k).indices)
                return logits, probs.gather(-1, chosen), chosen

            layer.mlp.gate.forward = routed
    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return F.pad(picked * batch.attention_mask[:, 1:], (1, 0))


def test_all_linear_adapts_the_attention_and_a_publish_serves_the_trainers_logprobs(
        moe_path, tmp_path):
    actor = make_engine(moe_path)
    adapted = sorted(actor.lora_config.target_modules)
    assert adapted == sorted(ATTENTION) and not actor.lora_config.target_parameters
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * len(ATTENTION) * 2  # 2 layers x 4 projections x (A, B)
    assert all(".self_attn." in n and ".lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters()
              if not p.requires_grad}
    assert any("mlp.experts.gate_up_proj" in n for n in frozen)
    for seed in range(3):  # trained adapters, away from their zero start
        actor.train_batch(sample(moe_path, 2, seed=seed).to_tensors(), nll_loss)
    for name, p in actor.model.named_parameters():
        if name in frozen:  # router, experts, norms, embedding: untouched
            assert torch.equal(p, frozen[name]), name
    actor.save_hf(str(tmp_path / "v1"))
    served = sample(moe_path, 4, adapter=str(tmp_path / "v1")).to_tensors()
    mask = served.loss_mask > 0
    assert (served.versions[mask] == 1).all()
    trainer = actor.compute_logprobs(served)
    base = hand_logprobs(moe_path, {}, served)
    assert (trainer - base)[mask].abs().max() > 1e-2  # the adapters do change the log-probs
    gap = (trainer - served.behavior_logprobs)[mask].abs().max().item()
    print(f"max |engine - trainer| log-prob after an MoE adapter publish: {gap:.2e}")
    assert gap < 1e-4  # fp32 on both sides, as the engine's parity tests
    actor.destroy()


def test_a_grpo_step_with_replay_follows_the_hand_written_gradient(moe_path):
    """GRPO (group-normalised rewards 1, 0, 1, 0; decoupled PPO loss) on the engine's
    completions with routing replay: at the first step every ratio is 1, so the loss is
    -mean(advantage) over the loss tokens and its gradient is that of -sum(adv * logp) / n
    through a hand-written LoRA and replayed routes; the step moves each adapter along it."""
    cfg = actor_config(moe_path, routing_replay=True, reward_norm=NormConfig(group_size=4),
                       optimizer=OptimizerConfig(lr=1e-3, eps=1.0, weight_decay=0.0,
                                                 gradient_clipping=0.0))
    engine = FSDPTrainEngine(TrainEngineSpec.of(cfg), total_steps=4)
    engine.initialize()
    randomise_lora_b(engine)
    tb = sample(moe_path, 4, seed=3).to_tensors()
    tb.advantages = compute_advantages(tb, cfg)
    tb.prox_logprobs = tb.behavior_logprobs = engine.compute_logprobs(tb)
    before = adapters_of(engine)
    grads = {}
    engine.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
        {n.removeprefix("hf."): p.grad.clone() for n, p in engine.model.named_parameters()
         if p.grad is not None}))
    stats = engine.train_batch(tb, make_ppo_loss_fn(cfg))

    mask = tb.loss_mask
    n = mask.sum()
    assert stats["loss"] == pytest.approx(float(-(tb.advantages * mask).sum() / n), abs=1e-6)
    hand = {m: (a.requires_grad_(), b.requires_grad_()) for m, (a, b) in before.items()}
    logprobs = hand_logprobs(moe_path, hand, tb, routes=tb.routed_experts)
    torch.testing.assert_close(logprobs * mask, tb.prox_logprobs * mask, atol=1e-5, rtol=0)
    (-(tb.advantages * logprobs * mask).sum() / n).backward()
    assert set(grads) == {f"{m}.{p}.default.weight" for m in hand for p in ("lora_A", "lora_B")}
    after = adapters_of(engine)
    for module, leaves in hand.items():
        for i, part in enumerate(("lora_A", "lora_B")):
            expected = leaves[i].grad
            assert expected.abs().max() > 1e-5
            torch.testing.assert_close(grads[f"{module}.{part}.default.weight"], expected,
                                       atol=1e-7, rtol=1e-4)
            # AdamW's first step (eps 1, no decay): -lr * g / (|g| + 1), elementwise; steps
            # of ~1e-6 read off fp32 weights up to ~0.8, whose spacing there is 6e-8
            step = after[module][i] - before[module][i]
            torch.testing.assert_close(step, -1e-3 * expected / (expected.abs() + 1.0),
                                       atol=1e-7, rtol=1e-4)
            assert step.abs().max() > 1e-6
    engine.destroy()


def test_adapters_on_the_router_or_the_experts_are_refused(moe_path):
    for modules in (["gate"], ["q_proj", "experts"]):
        with pytest.raises(ValueError, match=r"target_modules=.* adapts the MoE router or "
                                             r"experts \((gate|experts)\)"):
            make_engine(moe_path, target_modules=modules)
