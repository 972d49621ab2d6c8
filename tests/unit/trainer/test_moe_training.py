"""HF's Qwen3-MoE in the FSDP2 train engine: log-probs, a step on one and two gloo ranks, the
router load-balancing loss against HF's, and the MoE keys' errors."""

import dataclasses
import os

import pytest
import torch
from batches import random_batch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import ActorConfig, MicroBatchSpec, OptimizerConfig
from asyncrl.models.tiny import TINY_MOE, make_tiny_model
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.dist import free_port

pytestmark = pytest.mark.usefixtures("process_group")
LAYERS, TOP_K, EXPERTS = 2, TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe")


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


def make_engine(path, **overrides) -> FSDPTrainEngine:
    overrides.setdefault("optimizer", OptimizerConfig(lr=1e-3))
    overrides.setdefault("dtype", "float32")
    engine = FSDPTrainEngine(TrainEngineSpec(path=path, **overrides), total_steps=10)
    engine.initialize()
    return engine


def random_routes(batch, seed: int = 0) -> torch.Tensor:
    """Distinct random experts per token and layer [B, T, layers, top_k], int16."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch.input_ids.shape
    return torch.rand(b, t, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(
        torch.int16)


def hf_token_logprobs(path, batch):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 output_router_logits=True)
    picked = out.logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked * batch.attention_mask[:, 1:], (1, 0)), out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_moe_logprobs_match_hf_and_a_step_trains_every_parameter(moe_path, dtype):
    engine = make_engine(moe_path, dtype=dtype)
    batch = random_batch()
    expected, _ = hf_token_logprobs(moe_path, batch)
    # bf16 compute: about 3 significant digits on log-probs of magnitude up to ~10 here
    tolerance = {"float32": (1e-5, 1e-5), "bfloat16": (0.05, 0.02)}[dtype]
    torch.testing.assert_close(engine.compute_logprobs(batch), expected, atol=tolerance[0],
                               rtol=tolerance[1])
    before = engine.hf_state_dict()
    stats = engine.train_batch(batch, nll_loss)
    after = engine.hf_state_dict()
    assert "router_aux_loss" not in stats  # off by default
    assert any(".mlp.experts.gate_up_proj" in n for n in after)
    assert not [n for n in before if torch.equal(before[n], after[n])]
    engine.destroy()


def test_router_aux_loss_is_hfs_load_balancing_loss_times_the_coefficient(moe_path):
    """One micro-batch: the step's loss is the NLL plus coef * HF's load_balancing_loss_func
    over the batch's real tokens; two micro-batches weight each one's by its tokens."""
    batch = random_batch()
    expected_lp, out = hf_token_logprobs(moe_path, batch)
    n_tokens = int(batch.loss_mask.sum())
    nll = float(-(expected_lp * batch.loss_mask).sum()) / n_tokens
    aux = float(load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K,
                                         batch.attention_mask))
    engine = make_engine(moe_path, router_aux_loss_coef=0.5)
    stats = engine.train_batch(batch, nll_loss)
    assert stats["router_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert stats["loss"] == pytest.approx(nll + 0.5 * aux, rel=1e-5)
    engine.destroy()

    # rows (12, 10) and (7, 5) in two micro-batches of 22 and 12 real tokens
    engine = make_engine(moe_path, router_aux_loss_coef=0.5,
                         mb_spec=MicroBatchSpec(max_tokens_per_mb=24))
    stats = engine.train_batch(batch, nll_loss)
    parts = []
    for rows in ([0, 2], [1, 3]):
        mb = batch.select(rows)
        _, mb_out = hf_token_logprobs(moe_path, mb)
        mb_aux = float(load_balancing_loss_func(mb_out.router_logits, EXPERTS, TOP_K,
                                                mb.attention_mask))
        parts.append(mb_aux * int(mb.attention_mask.sum()) / 34)
    assert stats["n_mbs"] == 2
    assert stats["router_aux_loss"] == pytest.approx(sum(parts), rel=1e-5)
    engine.destroy()


def test_the_aux_loss_reaches_exactly_the_parameters_before_the_last_router(moe_path):
    """The aux loss reads the routers' logits: its gradient reaches every parameter upstream
    of the last layer's router, and not the last layer's experts, the final norm or the
    head (tied here to the embedding, which is upstream)."""
    grads = []
    for coef in (0.0, 10.0):
        engine = make_engine(moe_path, router_aux_loss_coef=coef,
                             optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=0.0))
        captured = {}
        clip = engine._clip_gradients

        def keep(engine=engine, captured=captured, clip=clip):
            captured.update({n: p.grad.clone() for n, p in engine.model.named_parameters()})
            return clip()

        engine._clip_gradients = keep
        engine.train_batch(random_batch(), nll_loss)
        grads.append(captured)
        engine.destroy()
    off, on = grads
    same = {n for n in off if torch.allclose(off[n], on[n], atol=1e-9, rtol=1e-6)}
    last = f"hf.model.layers.{LAYERS - 1}."
    assert same == {last + "mlp.experts.gate_up_proj", last + "mlp.experts.down_proj",
                    "hf.model.norm.weight"}


def test_moe_keys_on_a_dense_model_or_with_shared_prefix_are_refused(tiny_path, moe_path):
    with pytest.raises(ValueError, match="actor.routing_replay=true is for Mixture-of-Experts"):
        make_engine(tiny_path, routing_replay=True)
    with pytest.raises(ValueError, match=r"actor.router_aux_loss_coef=0.1 is for Mixture"):
        make_engine(tiny_path, router_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match="set actor.shared_prefix=false"):
        make_engine(moe_path, routing_replay=True, shared_prefix=True)
    with pytest.raises(ValueError, match="routing_replay=true needs each row's own prompt"):
        ActorConfig(routing_replay=True, shared_prefix=True)
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        ActorConfig(router_aux_loss_coef=-1.0)
    engine = make_engine(moe_path, routing_replay=True)
    with pytest.raises(ValueError, match="the batch carries no routed experts: the local "
                                         "backend records them, and sglang through"):
        engine.compute_logprobs(random_batch())
    engine.destroy()


DP_BATCH = dict(seed=2, lengths=(12, 7, 10, 5, 9, 4))
DP_OVERRIDES = dict(mb_spec=MicroBatchSpec(max_tokens_per_mb=14), routing_replay=True)
DP_OPTIMIZER = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0)


def dp_batch():
    batch = random_batch(**DP_BATCH)
    batch.routed_experts = random_routes(batch)
    return batch


def _data_parallel_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = make_engine(path, optimizer=dataclasses.replace(DP_OPTIMIZER), **DP_OVERRIDES)
    batch = dp_batch()
    logprobs = engine.compute_logprobs(batch)
    stats = engine.train_batch(batch, nll_loss)
    params = engine.hf_state_dict()
    if rank == 0:
        torch.save({"logprobs": logprobs, "stats": stats, "params": params},
                   os.path.join(out_dir, "result.pt"))
    engine.destroy()


def test_two_gloo_ranks_with_replayed_routes_match_one_rank(moe_path, tmp_path):
    torch.multiprocessing.spawn(_data_parallel_worker, args=(free_port(), moe_path,
                                                             str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "result.pt")
    engine = make_engine(moe_path, optimizer=dataclasses.replace(DP_OPTIMIZER), **DP_OVERRIDES)
    batch = dp_batch()
    torch.testing.assert_close(two["logprobs"], engine.compute_logprobs(batch),
                               atol=1e-6, rtol=1e-6)
    one = engine.train_batch(batch, nll_loss)
    assert two["stats"]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name, value in engine.hf_state_dict().items():
        torch.testing.assert_close(two["params"][name], value, atol=1e-6, rtol=1e-5)
    engine.destroy()
