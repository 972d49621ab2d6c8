"""Expert parallel training (actor.backend fsdp:d<M>e<E>, trainer/experts.py) on the CPU with
gloo: a tiny Qwen3-MoE (8 experts, top 2) on e2, each rank holding 4 experts of every
layer, trains as one rank does on the same batch: log-probs, loss, router aux loss,
gradient norm, each rank's expert gradients and the published weights after a step.

Tolerance: fp32 compute. The experts' matmuls run on the group's gathered rows instead of
one rank's micro-batch rows, and gradients are summed over ranks in another order, so
values agree to a few fp32 roundings, not bit for bit: relative 1e-5 (log-probs also
absolute 1e-5). Observed on e2 here: loss and aux loss 1.5e-8 apart (relative), the
gradient norm equal, log-probs 1e-6 (absolute), gradients 9e-7 of their largest entry,
weights after the step 1.2e-7 (relative).
"""

import dataclasses
import os

import pytest
import torch
from batches import random_batch
from torch.distributed.tensor import DTensor

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.controller.plan import ModelShape, plan_trainer, train_layout
from asyncrl.models.tiny import TINY_MOE, make_tiny_model
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.dist import free_port
from asyncrl.trainer.experts import check_model
from asyncrl.trainer.parallel import Layout

pytestmark = pytest.mark.usefixtures("process_group")
EXPERTS, TOP_K, LAYERS = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"], 2
# Every pair of rows is over 12 tokens: one row per micro-batch on one rank and on two, so
# the per-micro-batch load-balancing loss sums the same terms.
BATCH = dict(seed=2, lengths=(12, 7, 10, 8, 9, 11))
MB_SPEC = MicroBatchSpec(max_tokens_per_mb=12)
# gradient_clipping 1.0 is below the gradient norm: the clip runs on split gradients.
# eps=1.0 keeps AdamW's first step proportional to the gradient, so a wrong gradient shows.
OPTIMIZER = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=1.0)
CASES = {"replay_aux": {"routing_replay": True, "router_aux_loss_coef": 0.5},
         "prefix_aux": {"shared_prefix": True, "router_aux_loss_coef": 0.5}}


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ep") / "m", arch="qwen3_moe")


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


def make_batch():
    batch = random_batch(**BATCH)
    g = torch.Generator().manual_seed(0)
    b, t = batch.input_ids.shape  # distinct random experts per token and layer
    batch.routed_experts = torch.rand(b, t, LAYERS, EXPERTS, generator=g).argsort(-1)[
        ..., :TOP_K].to(torch.int16)
    return batch


def make_engine(path, case, backend=None):
    spec = TrainEngineSpec(path=path, dtype="float32", optimizer=dataclasses.replace(OPTIMIZER),
                           mb_spec=MB_SPEC, backend=backend, **CASES[case])
    engine = FSDPTrainEngine(spec, total_steps=10)
    engine.initialize()
    return engine


def step(engine):
    """Log-probs, one step's stats, the gradients it clipped (whole, and this rank's part of
    the experts') and the weights after it."""
    grads, local = {}, {}
    clip = engine._clip_gradients

    def keep():
        for name, p in engine.model.named_parameters():
            g = p.grad
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
            if isinstance(g, DTensor) and "experts" in name:
                local[name] = g.to_local().clone()
        return clip()

    engine._clip_gradients = keep
    batch = make_batch()
    logprobs = engine.compute_logprobs(batch)
    stats = engine.train_batch(batch, nll_loss)
    engine._clip_gradients = clip
    return {"logprobs": logprobs, "stats": stats, "grads": grads, "local": local,
            "params": engine.hf_state_dict()}


def _worker(rank, world, port, path, case, backend, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = make_engine(path, case, backend)
    result = step(engine)
    result["shapes"] = {n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters()
                        if isinstance(p, DTensor) and "experts" in n}
    result["numel"] = {n: (p.to_local() if isinstance(p, DTensor) else p).numel()
                       for n, p in engine.model.named_parameters()}
    engine.save_state(os.path.join(out_dir, "state"))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    engine.destroy()


@pytest.mark.parametrize("backend, world, case", [
    # ~25 s here: the one run that covers routing replay and the aux loss too
    ("fsdp:d1e2", 2, "replay_aux"),
    # the trie forward's packed node rows (padding nodes included) through the exchange
    pytest.param("fsdp:d1e2", 2, "prefix_aux", marks=pytest.mark.slow),
    # experts also FSDP-sharded over the d2 ranks that hold the same ones
    pytest.param("fsdp:d2e2", 4, "replay_aux", marks=pytest.mark.slow),
])
def test_an_expert_mesh_trains_as_one_rank_does(moe_path, tmp_path, backend, world, case):
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), moe_path, case, backend,
                                               str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    engine = make_engine(moe_path, case)
    one = step(engine)
    keys = ["loss", "grad_norm", "router_aux_loss"]
    for got in ranks:
        torch.testing.assert_close(got["logprobs"], one["logprobs"], atol=1e-5, rtol=1e-5)
        for key in keys:
            assert got["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5), key
        for name, grad in one["grads"].items():  # whole gradients, gathered
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-7, rtol=1e-5)
    assert one["stats"]["grad_norm"] > 2 * OPTIMIZER.gradient_clipping  # the clip did act
    per_rank = EXPERTS // 2
    for r, got in enumerate(ranks if world == 2 else []):  # d1: a rank's part is its experts
        # Each rank holds 4 of the 8 experts of each layer, and their gradient is the one
        # rank's for those experts: every token of the group routed there reached it.
        assert sorted(got["local"]) == sorted(n for n in one["grads"] if "experts" in n)
        for name, grad in got["local"].items():
            assert got["shapes"][name] == (per_rank, *grad.shape[1:])
            torch.testing.assert_close(grad, one["grads"][name][r * per_rank:(r + 1) * per_rank],
                                       atol=1e-7, rtol=1e-5)
    _check_the_plan_s_rank_params(moe_path, backend, ranks)
    published = ranks[0]["params"]
    assert not any(r["params"] for r in ranks[1:])
    assert sorted(published) == sorted(one["params"])
    for name, value in one["params"].items():
        assert published[name].shape == value.shape, name
        torch.testing.assert_close(published[name], value, atol=1e-6, rtol=1e-5)
    engine.load_state(str(tmp_path / "state"))  # the mesh's sharded state, read by one rank
    for name, value in engine.hf_state_dict().items():
        assert torch.equal(value, published[name]), name
    engine.destroy()


def _check_the_plan_s_rank_params(path, backend, ranks):
    """`asyncrl plan`'s parameters per rank (its fp32 gradients / 4) against the numel of
    each rank's local shards."""
    shape = ModelShape.of(path)
    layout = train_layout(backend)
    planned = plan_trainer(shape, layout=layout, device="cpu",
                           tokens_per_mb=12)["gradients (fp32)"] // 4
    world, experts = layout.world_size, shape.rank_expert_params(layout.expert) // layout.data
    assert experts == LAYERS * EXPERTS * 3 * 64 * 32 // world  # gate, up, down of 64 x 32
    for got in ranks:
        # a rank's experts: exactly its 1/e, FSDP-split evenly over the d ranks that hold them
        assert sum(n for name, n in got["numel"].items() if "experts" in name) == experts
        # the rest: FSDP2 splits each tensor's rows over the world, the last rank's chunk
        # shorter where they do not divide, so a rank is within a few rows of 1/world
        assert abs(sum(got["numel"].values()) - planned) < 0.01 * planned
    assert sum(sum(got["numel"].values()) for got in ranks) == world * planned == shape.n_params


def test_expert_parallel_sizes_are_checked_against_the_model(moe_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_path)
    assert check_model(model, 4) == 8
    with pytest.raises(ValueError, match=r"e3 \(actor.backend\) must divide the model's "
                                         r"num_experts=8: .* use e in \[1, 2, 4, 8\]"):
        check_model(model, 3)
    dense = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "dense"))
    with pytest.raises(ValueError, match="and llama has none; use e1"):
        check_model(dense, 2)


def test_an_expert_layout_splits_the_batch_over_every_rank():
    layout = Layout.of("fsdp:d2e2", 4)
    assert (layout.batch_groups, [layout.data_rank(r) for r in range(4)]) == (4, [0, 1, 2, 3])
    tp = Layout.of("fsdp:d2t2", 4)  # a tensor group shares its rows
    assert (tp.batch_groups, [tp.data_rank(r) for r in range(4)]) == (2, [0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"asks for 1 x 4 = 4 trainer ranks but this world "
                                         r"has 2"):
        Layout.of("fsdp:d1e4", 2)
