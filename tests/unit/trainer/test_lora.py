"""LoRA in the train engine: adapter-only gradients, the base as the KL reference, data
parallel ranks, resume, publishing to our engine and exporting a merged model."""

import dataclasses
import json
import os

import pytest
import torch
from batches import random_batch as make_batch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import functional as F

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.models import lora as lora_files
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.dist import free_port

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("process_group")

RANK, ALPHA = 4, 8  # scaling alpha / r = 2
TARGETS = ("q_proj", "v_proj", "down_proj")


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    """Token-level negative log-likelihood, normalised by the whole batch's loss tokens."""
    return -(logprobs * mb.loss_mask).sum() / n_tokens, {}


def make_engine(path, *, total_steps=10, **overrides) -> FSDPTrainEngine:
    overrides.setdefault("optimizer", OptimizerConfig(lr=1e-2, gradient_clipping=0.0))
    overrides.setdefault("dtype", "float32")
    overrides.setdefault("target_modules", TARGETS)
    spec = TrainEngineSpec(path=path, use_lora=True, lora_rank=RANK, lora_alpha=ALPHA,
                           **overrides)
    engine = FSDPTrainEngine(spec, total_steps=total_steps)
    engine.initialize()
    return engine


def randomise_lora_b(engine, seed=0) -> None:
    """PEFT starts B at 0 (so A has no gradient yet): give it values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if ".lora_B." in name:
                value = torch.randn(p.shape, generator=g) * 0.2
                if isinstance(p, DTensor):  # FSDP's shard of it
                    value = distribute_tensor(value, p.device_mesh, p.placements)
                p.copy_(value)


def adapters_by_module(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path in the HF model: (A, B)} of the engine's adapters, cloned."""
    params = dict(engine.model.named_parameters())
    out = {}
    for name, a in params.items():
        if ".lora_A.default.weight" in name:
            module = name.removeprefix("hf.").removesuffix(".lora_A.default.weight")
            b = params[name.replace("lora_A", "lora_B")]
            out[module] = (a.detach().clone(), b.detach().clone())
    return out


def hand_lora_logprobs(path, adapters, batch, scaling):
    """Token log-probs of the HF base with W x + scaling * B A x written out by hand in each
    adapted Linear (A, B leaves that take gradients); full log_softmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = dict(hf.named_modules())
    for name, (a, b) in adapters.items():
        layer = modules[name]

        def forward(x, w=layer.weight, a=a, b=b):
            return F.linear(x, w) + scaling * ((x @ a.T) @ b.T)

        layer.forward = forward
    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return F.pad(picked * batch.attention_mask[:, 1:], (1, 0))


@pytest.mark.parametrize("overrides", [{}, {"gradient_checkpointing": True},
                                       {"shared_prefix": True}],
                         ids=["plain", "gradient_checkpointing", "shared_prefix"])
def test_only_adapters_take_gradients_and_equal_a_hand_written_lora(tiny_path, overrides):
    engine = make_engine(tiny_path, **overrides)
    randomise_lora_b(engine)
    adapters = adapters_by_module(engine)
    assert len(adapters) == 2 * len(TARGETS)  # two layers
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in engine.model.parameters() if p.requires_grad}
    grads = {}
    engine.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
        {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}))
    base_before = {n: p.detach().clone() for n, p in engine.model.named_parameters()
                   if not p.requires_grad}
    batch = make_batch()
    engine.train_batch(batch, nll_loss)

    assert set(grads) == trainable  # no frozen weight got a gradient
    hand = {m: (a.requires_grad_(), b.requires_grad_()) for m, (a, b) in adapters.items()}
    logprobs = hand_lora_logprobs(tiny_path, hand, batch, ALPHA / RANK)
    loss = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    for module, (a, b) in hand.items():
        for part, leaf in (("lora_A", a), ("lora_B", b)):
            ours = grads[f"hf.{module}.{part}.default.weight"]
            assert leaf.grad.abs().max() > 1e-4  # a gradient worth comparing
            torch.testing.assert_close(ours, leaf.grad, atol=1e-6, rtol=1e-4)
    for name, before in base_before.items():
        assert torch.equal(dict(engine.model.named_parameters())[name], before), name
    engine.destroy()


def test_the_kl_reference_is_the_base_with_adapters_off_and_no_second_model(tiny_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.config import load_config
    from asyncrl.trainer.frozen import LoraBase, make_ref_engine

    engine = make_engine(tiny_path)
    randomise_lora_b(engine)
    batch = make_batch()
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    base = F.pad(picked * batch.attention_mask[:, 1:], (1, 0))
    cfg = load_config(None, ["train_dataset.path=x", f"actor.path={tiny_path}",
                             "actor.use_lora=true", "actor.kl_ctl=0.1"])
    ref = make_ref_engine(cfg.actor, cfg.ref, seed=cfg.seed, device="cpu", actor_engine=engine)
    assert isinstance(ref, LoraBase)
    ref.initialize()
    torch.testing.assert_close(ref.compute_logprobs(batch), base, atol=1e-5, rtol=1e-5)
    # The adapters are back on afterwards, and they do change the log-probs.
    assert (engine.compute_logprobs(batch) - base).abs().max() > 1e-2
    engine.destroy()


DP_BATCH = {"seed": 2, "lengths": (12, 7, 10, 5, 9, 4)}
DP_OVERRIDES = {"mb_spec": MicroBatchSpec(max_tokens_per_mb=14)}


def _data_parallel_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = make_engine(path, **DP_OVERRIDES)
    randomise_lora_b(engine)  # the same seed on both ranks: the same values
    batch = make_batch(**DP_BATCH)
    stats = engine.train_batch(batch, nll_loss)
    logprobs = engine.compute_logprobs(batch)
    engine.save_hf(os.path.join(out_dir, "adapter"))
    engine.save_state(os.path.join(out_dir, "state"))
    if rank == 0:
        torch.save({"logprobs": logprobs, "stats": stats}, os.path.join(out_dir, "result.pt"))
    engine.destroy()


def test_two_fsdp_ranks_train_the_adapters_as_one_rank_and_their_state_loads_at_one(
        tiny_path, tmp_path):
    torch.multiprocessing.spawn(_data_parallel_worker,
                                args=(free_port(), tiny_path, str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "result.pt")
    two_adapter = load_file(tmp_path / "adapter" / lora_files.WEIGHTS_FILE)
    engine = make_engine(tiny_path, **DP_OVERRIDES)
    randomise_lora_b(engine)
    batch = make_batch(**DP_BATCH)
    one = engine.train_batch(batch, nll_loss)
    assert two["stats"]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    torch.testing.assert_close(two["logprobs"], engine.compute_logprobs(batch),
                               atol=1e-5, rtol=1e-5)
    engine.save_hf(str(tmp_path / "one_adapter"))
    one_adapter = load_file(tmp_path / "one_adapter" / lora_files.WEIGHTS_FILE)
    assert set(one_adapter) == set(two_adapter) and len(one_adapter) == 4 * len(TARGETS)
    for name, value in one_adapter.items():
        torch.testing.assert_close(two_adapter[name], value, atol=1e-6, rtol=1e-5)

    engine.load_state(str(tmp_path / "state"))  # saved by two ranks, loaded by one
    reloaded = adapters_by_module(engine)
    for module, (a, b) in reloaded.items():
        assert torch.equal(a, two_adapter[lora_files.peft_name(module, "lora_A")])
        assert torch.equal(b, two_adapter[lora_files.peft_name(module, "lora_B")])
    engine.destroy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_restores_adapters_and_optimiser_and_continues_exactly(tiny_path, tmp_path,
                                                                       dtype):
    optimizer = OptimizerConfig(lr=1e-2, lr_scheduler_type="linear", min_lr_ratio=0.1)
    first = make_engine(tiny_path, optimizer=optimizer, total_steps=4, dtype=dtype)
    first.train_batch(make_batch(seed=0), nll_loss)
    first.save_state(str(tmp_path / "state"))
    expected_lrs = [first.train_batch(make_batch(seed=s), nll_loss)["lr"] for s in (1, 2)]
    expected = adapters_by_module(first)
    first.destroy()
    # The checkpoint holds the adapters and their AdamW moments, not the base weights.
    metadata = (tmp_path / "state" / ".metadata").read_bytes()
    assert b"lora_A" in metadata and b"exp_avg" in metadata
    assert b"base_layer" not in metadata and b"embed_tokens" not in metadata

    resumed = make_engine(tiny_path, optimizer=dataclasses.replace(optimizer), total_steps=4,
                          dtype=dtype)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.steps_done == 1
    lrs = [resumed.train_batch(make_batch(seed=s), nll_loss)["lr"] for s in (1, 2)]
    assert lrs == expected_lrs == pytest.approx([0.775e-2, 0.55e-2])
    for module, (a, b) in adapters_by_module(resumed).items():
        assert torch.equal(a, expected[module][0]) and torch.equal(b, expected[module][1])
    resumed.destroy()


def _engine_vs_trainer(path: str, actor, dtype: str, adapter_dir: str) -> float:
    """Mean |engine - trainer| log-prob of 4 x 24 tokens the engine sampled after loading
    the adapter folder as version 1 (every token must carry version 1)."""
    from asyncrl.api import Batch, GenerationRequest, SamplingParams, Trajectory
    from asyncrl.config import LocalEngineConfig
    from asyncrl.inference.server.engine import LocalEngine

    engine = LocalEngine(path, LocalEngineConfig(dtype=dtype, max_batch_size=4,
                                                 max_seq_len=128), seed=0)
    engine.update_weights(adapter_dir, version=1)
    done = []
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.submit(GenerationRequest(input_ids=[1, 60 + i, 61, 62, 63], sampling=params),
                      done.append)
    while len(done) < 4:
        engine.step()
    engine.close()
    tb = Batch([Trajectory.from_response(r, reward=0.0, group_id="g") for r in done]).to_tensors()
    mask = tb.loss_mask.bool()
    assert (tb.versions[mask] == 1).all()
    return (actor.compute_logprobs(tb)[mask] - tb.behavior_logprobs[mask]).abs().mean().item()


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_published_adapters_give_the_engine_the_trainers_logprobs(tmp_path, dtype, tolerance):
    from asyncrl.models.tiny import make_tiny_model

    # The shape of the engine's bf16 parity test (test_decode_kernel.py), whose bound is
    # the bf16 tolerance here; fp32 on both sides must agree to float roundings.
    path = make_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2, hidden_size=128,
                           head_dim=32)
    actor = make_engine(path, dtype=dtype, target_modules=("all-linear",))
    for seed in range(3):  # trained adapters, far from their zero start
        actor.train_batch(make_batch(seed=seed), nll_loss)
    published = tmp_path / "v1"
    actor.save_hf(str(published), dtype=getattr(torch, dtype))
    adapter = load_file(published / lora_files.WEIGHTS_FILE)
    # 7 projections x 2 layers x (A + B) and nothing else: the bytes of the adapters alone.
    assert len(adapter) == 28
    n_bytes = sum(p.numel() for n, p in actor.model.named_parameters()
                  if p.requires_grad) * torch.tensor([], dtype=getattr(torch, dtype)).itemsize
    assert os.path.getsize(published / lora_files.WEIGHTS_FILE) < n_bytes + 8192
    config = json.loads((published / lora_files.CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        RANK, ALPHA, path)
    gap = _engine_vs_trainer(path, actor, dtype, str(published))
    print(f"{dtype}: mean |engine - trainer| log-prob after an adapter publish: {gap:.2e}")
    assert gap < tolerance
    actor.destroy()


def test_export_merged_writes_base_plus_scaled_b_a_and_loads_in_transformers(tiny_path,
                                                                             tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.cli import main

    engine = make_engine(tiny_path)
    randomise_lora_b(engine)
    engine.save_hf(str(tmp_path / "adapter"))
    adapters = adapters_by_module(engine)
    batch = make_batch()
    trained = engine.compute_logprobs(batch)
    engine.destroy()
    assert main(["export-merged", "--adapter", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 0

    base = load_file(os.path.join(tiny_path, "model.safetensors"))
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(base)
    for name, value in merged.items():
        module = name.removesuffix(".weight")
        if module in adapters:
            a, b = adapters[module]
            expected = base[name] + (ALPHA / RANK) * (b @ a)  # by hand
            torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(value, base[name]), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(F.pad(picked * batch.attention_mask[:, 1:], (1, 0)), trained,
                               atol=1e-5, rtol=1e-5)


def test_export_merged_refuses_a_folder_without_an_adapter(tiny_path, tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["export-merged", "--adapter", tiny_path, "--out", str(tmp_path / "m")]) == 2
    assert "is not a LoRA adapter folder (no adapter_config.json)" in capsys.readouterr().err


def test_an_adapter_of_another_model_is_refused_naming_the_weight():
    adapter = lora_files.Adapter(2.0, {"model.layers.0.self_attn.q_proj.weight": (
        torch.zeros(4, 8), torch.zeros(6, 4))})
    base = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(6, 16))]
    with pytest.raises(lora_files.AdapterError, match=r"q_proj.weight is 6x8 but the base "
                       r"weight is \(6, 16\)"):
        list(lora_files.merged(base, adapter))
    with pytest.raises(lora_files.AdapterError, match=r"that the base model lacks"):
        list(lora_files.merged([], adapter))


def test_targets_outside_the_decoders_linear_layers_are_refused(tiny_path):
    with pytest.raises(ValueError, match=r"target_modules=\['nope_proj'\].*use \[all-linear\]"):
        make_engine(tiny_path, target_modules=("nope_proj",))
    with pytest.raises(ValueError, match=r"only the decoder's linear layers"):
        make_engine(tiny_path, target_modules=("embed_tokens",))
