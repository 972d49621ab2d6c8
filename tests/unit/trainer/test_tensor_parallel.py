"""Tensor parallel training (actor.backend fsdp:d<M>t<S>, trainer/parallel.py) on the CPU with
gloo: the same batch on one rank and on d2, t2 and d2t2 meshes gives the same log-probs,
loss, gradient norm and published weights.

Tolerance: fp32 compute; a split matmul sums its products in another order (o_proj and
down_proj add S partial sums), so values agree to a few fp32 roundings, not bit for bit:
relative 1e-5 (log-probs also absolute 1e-5), observed about 1e-6 here.
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from batches import random_batch

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.dist import free_port
from asyncrl.trainer.parallel import Layout, check_model, layer_plan

pytestmark = pytest.mark.usefixtures("process_group")

BATCH = dict(seed=2, lengths=(12, 7, 10, 5, 9, 4))
# gradient_clipping 1.0 is below the gradient norm (~8): the clip runs on split gradients.
# eps=1.0 keeps AdamW's first step proportional to the gradient, so a wrong gradient shows.
OPTIMIZER = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=1.0)
MB_SPEC = MicroBatchSpec(max_tokens_per_mb=14)  # several micro-batches per data rank


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    """Token-level negative log-likelihood, normalised by the whole batch's loss tokens."""
    loss = -(logprobs * mb.loss_mask).sum() / n_tokens
    return loss, {"nll_tokens": float(mb.loss_mask.sum())}


def _engine(path, backend=None):
    spec = TrainEngineSpec(path=path, dtype="float32", optimizer=dataclasses.replace(OPTIMIZER),
                           mb_spec=MB_SPEC, backend=backend)
    engine = FSDPTrainEngine(spec, total_steps=10)
    engine.initialize()
    return engine


def _step(engine):
    batch = random_batch(**BATCH)
    logprobs = engine.compute_logprobs(batch)
    stats = engine.train_batch(batch, nll_loss)
    return {"logprobs": logprobs, "stats": stats, "params": engine.hf_state_dict()}


def _worker(rank, world, port, path, backend, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = _engine(path, backend)
    result = _step(engine)
    engine.save_state(os.path.join(out_dir, "state"))
    result["rank_stats"] = engine.train_batch(random_batch(**BATCH), nll_loss)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    engine.destroy()


@pytest.mark.parametrize("arch, backend, world", [
    ("llama", "fsdp:d2", 2),  # data parallel alone, through the same mesh code
    ("qwen2", "fsdp:d1t2", 2),  # q/k/v biases split with their weights
    # q_norm/k_norm per head, data and tensor groups (slow: four ranks on the CI's two cores)
    pytest.param("qwen3", "fsdp:d2t2", 4, marks=pytest.mark.slow),
])
def test_a_mesh_trains_as_one_rank_does(tmp_path, arch, backend, world):
    # 4 heads over 2 kv heads and an MLP of 128: both split evenly over t2.
    path = make_tiny_model(tmp_path / arch, arch=arch, num_heads=4, num_kv_heads=2,
                           head_dim=16)
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), path, backend,
                                               str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    engine = _engine(path)
    one = _step(engine)
    for got in ranks:  # every rank holds the whole batch's log-probs and stats
        torch.testing.assert_close(got["logprobs"], one["logprobs"], atol=1e-5, rtol=1e-5)
        assert got["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5)
        assert got["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=1e-5)
        # Summed over data groups only: each loss token counted once, not once per tp rank.
        assert got["stats"]["nll_tokens"] == one["stats"]["nll_tokens"] == 29
    assert one["stats"]["grad_norm"] > 2 * OPTIMIZER.gradient_clipping  # the clip did act
    published = ranks[0]["params"]  # rank 0 gathers whole tensors; the others get none
    assert all(not r["params"] for r in ranks[1:])
    assert sorted(published) == sorted(one["params"])
    for name, value in one["params"].items():
        assert published[name].shape == value.shape, name
        torch.testing.assert_close(published[name], value, atol=1e-6, rtol=1e-5)
    second = engine.train_batch(random_batch(**BATCH), nll_loss)
    assert ranks[0]["rank_stats"]["loss"] == pytest.approx(second["loss"], rel=1e-5)
    engine.load_state(str(tmp_path / "state"))  # the mesh's sharded state, read by one rank
    for name, value in engine.hf_state_dict().items():
        assert torch.equal(value, published[name]), name
    engine.destroy()


def _config(model_type="llama", heads=4, kv_heads=2, intermediate=128):
    return SimpleNamespace(model_type=model_type, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=intermediate)


def test_sizes_that_do_not_split_evenly_are_named_with_the_sizes_that_would():
    check_model(_config(), 2)
    with pytest.raises(ValueError, match=r"t4 \(actor.backend\) must divide the model's "
                                         r"num_key_value_heads=2: .* use t in \[1, 2\]"):
        check_model(_config(), 4)
    with pytest.raises(ValueError, match=r"num_attention_heads=6, num_key_value_heads=6, "
                                         r"intermediate_size=102"):
        check_model(_config(heads=6, kv_heads=6, intermediate=102), 4)
    with pytest.raises(ValueError, match="not model_type 'gpt2'; use t1 in actor.backend"):
        check_model(_config("gpt2"), 2)


def test_the_layout_must_match_the_ranks_started():
    assert Layout.of(None, 4) == Layout(4, 1)
    layout = Layout.of("fsdp:d2t2", 4)
    assert [layout.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"actor.backend='fsdp:d1t4' asks for 1 x 4 = 4 "
                                         r"trainer ranks but this world has 2"):
        Layout.of("fsdp:d1t4", 2)


def test_only_qwen3_layers_get_their_per_head_norms_split(tmp_path):
    from transformers import AutoModelForCausalLM

    plans = {}
    for arch in ("llama", "qwen3"):
        path = make_tiny_model(tmp_path / arch, arch=arch, num_heads=4, num_kv_heads=2,
                               head_dim=16)
        layer = AutoModelForCausalLM.from_pretrained(path).model.layers[0]
        plans[arch] = sorted(layer_plan(layer))
    projections = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                   "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert plans["llama"] == projections
    assert plans["qwen3"] == sorted(projections + ["self_attn.k_norm", "self_attn.q_norm"])


def test_the_trie_attention_is_refused_on_split_heads(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.engine import TokenLogprobModel, _check_packable

    path = make_tiny_model(tmp_path / "llama", num_heads=4, num_kv_heads=2, head_dim=16)
    model = TokenLogprobModel(AutoModelForCausalLM.from_pretrained(path), 1.0)
    _check_packable(model, Layout(2, 1))
    with pytest.raises(ValueError, match="heads split over t2 ranks .* set shared_prefix to "
                                         "false"):
        _check_packable(model, Layout(1, 2))
