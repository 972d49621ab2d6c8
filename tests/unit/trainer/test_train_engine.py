"""The FSDP2 train engine on a tiny random model, world size 1 on the CPU."""

import dataclasses
import math
import os

import pytest
import torch
from batches import random_batch as make_batch

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine, split_across_ranks, split_by_token_budget
from asyncrl.trainer import engine as engine_module
from asyncrl.trainer.cpu import logprob_head, optim
from asyncrl.trainer.cpu.optim import lr_factor
from asyncrl.trainer.cpu.options import set_cpu_paths
from asyncrl.trainer.dist import free_port
from asyncrl.trainer.updates import merge_update_stats, split_minibatches, train_epochs

pytestmark = pytest.mark.usefixtures("process_group")


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    """Token-level negative log-likelihood, normalised by the whole batch's loss tokens."""
    loss = -(logprobs * mb.loss_mask).sum() / n_tokens
    worst = float(-logprobs.detach()[mb.loss_mask > 0].min())
    return loss, {"nll_tokens": float(mb.loss_mask.sum()), "nll_max": worst}


def token_logprobs(logits: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """The reference: full log_softmax, gathered, shifted to the token alignment, 0 on padding."""
    logprobs = torch.log_softmax(logits[:, :-1], -1)
    picked = logprobs.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked * batch.attention_mask[:, 1:], (1, 0))


def make_engine(path, *, total_steps=10, **overrides) -> FSDPTrainEngine:
    overrides.setdefault("optimizer", OptimizerConfig(lr=1e-3))
    overrides.setdefault("dtype", "float32")
    spec = TrainEngineSpec(path=path, **overrides)
    engine = FSDPTrainEngine(spec, total_steps=total_steps)
    engine.initialize()
    return engine


def test_token_budget_packs_sorted_rows_and_isolates_long_ones():
    # Longest first: 30 and 9 alone (2 * 9 > 12); 6 with 5 (2 * 6 <= 12); 4 with 3.
    groups = split_by_token_budget([5, 9, 4, 6, 30, 3], max_tokens=12)
    assert groups == [[4], [1], [3, 0], [2, 5]]


def test_ranks_get_balanced_token_loads():
    parts = split_across_ranks([10, 9, 2, 1], world_size=2)
    assert parts == [[0, 3], [1, 2]]


@pytest.mark.parametrize("kind, expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # 2 warmup steps, then decay over the 4 others; min_lr_ratio 0.2 would be step 6's.
    ("linear", [0.5, 1.0, 1.0, 0.8, 0.6, 0.4]),
    ("cosine", [0.5, 1.0, 1.0, 0.6 + 0.4 * 0.5 ** 0.5, 0.6, 0.6 - 0.4 * 0.5 ** 0.5]),
])
def test_lr_schedule_warms_up_then_decays_to_min_ratio(kind, expected):
    factors = [lr_factor(step, kind=kind, total_steps=6, warmup_steps=2, min_lr_ratio=0.2)
               for step in range(6)]
    assert factors == pytest.approx(expected)


def test_compute_logprobs_matches_an_independent_hf_forward(tiny_path):
    from transformers import AutoModelForCausalLM

    engine = make_engine(tiny_path, temperature=0.7)
    batch = make_batch()
    ours = engine.compute_logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = token_logprobs(logits / 0.7, batch)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert (ours[:, 0] == 0).all() and (ours[~batch.attention_mask] == 0).all()
    engine.destroy()


def test_every_trainable_parameter_changes_after_one_step(tiny_path):
    engine = make_engine(tiny_path)
    before = engine.hf_state_dict()
    stats = engine.train_batch(make_batch(), nll_loss)
    after = engine.hf_state_dict()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged
    assert stats["n_tokens"] == 22 and stats["n_seqs"] == 4 and stats["grad_norm"] > 0
    assert stats["nll_tokens"] == 22  # summed over micro-batches
    engine.destroy()


def test_micro_batched_chunked_step_equals_one_big_micro_batch(tiny_path, monkeypatch):
    # Adam's first step is ~lr * sign(grad); eps = 1 makes it ~lr * grad for these small
    # gradients, so the parameters also check the gradients' scale.
    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0)
    results = []
    for max_tokens, logits_per_chunk in ((10_000, 2**25), (12, 3 * 320)):
        # 3 tokens per vocabulary-projection chunk (vocab 320): several chunks.
        monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", logits_per_chunk)
        engine = make_engine(tiny_path, optimizer=dataclasses.replace(optimizer),
                             mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens))
        stats = engine.train_batch(make_batch(), nll_loss)
        results.append((stats, engine.hf_state_dict()))
        engine.destroy()
    (one, params_one), (many, params_many) = results
    assert one["n_mbs"] == 1 and many["n_mbs"] == 4
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert many["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert many["nll_max"] == pytest.approx(one["nll_max"], rel=1e-6)  # max over micro-batches
    for name in params_one:
        torch.testing.assert_close(params_many[name], params_one[name], atol=1e-6, rtol=1e-5)


def test_save_hf_round_trips_through_transformers(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = make_engine(tiny_path)
    engine.train_batch(make_batch(), nll_loss)  # weights differ from the tiny model's
    batch = make_batch(seed=1)
    ours = engine.compute_logprobs(batch)
    engine.save_hf(str(tmp_path / "fp32"))
    engine.save_hf(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    engine.destroy()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    with torch.no_grad():
        logits = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    theirs = token_logprobs(logits, batch)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(tmp_path / "fp32").pad_token == "<|endoftext|>"

    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert bf16.config.dtype == torch.bfloat16
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16


def test_resume_from_saved_state_continues_exactly(tiny_path, tmp_path):
    # Linear decay: lr factors 1, 0.775, 0.55, 0.325; a scheduler that forgot its state
    # would repeat 0.775 on the second step after the restart.
    optimizer = OptimizerConfig(lr=1e-2, lr_scheduler_type="linear", min_lr_ratio=0.1)
    first = make_engine(tiny_path, optimizer=optimizer, total_steps=4)
    first.train_batch(make_batch(seed=0), nll_loss)
    first.save_state(str(tmp_path / "state"))
    expected_lrs = [first.train_batch(make_batch(seed=s), nll_loss)["lr"] for s in (1, 2)]
    expected = first.hf_state_dict()
    first.destroy()

    resumed = make_engine(tiny_path, optimizer=dataclasses.replace(optimizer), total_steps=4)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.steps_done == 1
    lrs = [resumed.train_batch(make_batch(seed=s), nll_loss)["lr"] for s in (1, 2)]
    assert lrs == expected_lrs == pytest.approx([0.775e-2, 0.55e-2])
    for name, value in resumed.hf_state_dict().items():
        assert torch.equal(value, expected[name]), name
    resumed.destroy()


DP_BATCH = dict(seed=2, lengths=(12, 7, 10, 5, 9, 4))
# With 14 tokens per micro-batch rank 0 gets rows of 12 | 7, 5 and rank 1 rows of
# 10 | 9 | 4: rank 0 has to run a zero-weight micro-batch to keep the collectives in step.
DP_OVERRIDES = dict(mb_spec=MicroBatchSpec(max_tokens_per_mb=14))
DP_OPTIMIZER = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0)


def _data_parallel_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = make_engine(path, optimizer=dataclasses.replace(DP_OPTIMIZER), **DP_OVERRIDES)
    batch = make_batch(**DP_BATCH)
    logprobs = engine.compute_logprobs(batch)
    stats = engine.train_batch(batch, nll_loss)
    params = engine.hf_state_dict()
    engine.save_state(os.path.join(out_dir, "state"))
    if rank == 0:
        torch.save({"logprobs": logprobs, "stats": stats, "params": params},
                   os.path.join(out_dir, "result.pt"))
    engine.destroy()


def test_two_data_parallel_ranks_match_one_rank_and_their_state_loads_at_one(tiny_path, tmp_path):
    torch.multiprocessing.spawn(_data_parallel_worker, args=(free_port(), tiny_path, str(tmp_path)),
                                nprocs=2)
    two = torch.load(tmp_path / "result.pt")
    engine = make_engine(tiny_path, optimizer=dataclasses.replace(DP_OPTIMIZER), **DP_OVERRIDES)
    batch = make_batch(**DP_BATCH)
    torch.testing.assert_close(two["logprobs"], engine.compute_logprobs(batch),
                               atol=1e-6, rtol=1e-6)
    one = engine.train_batch(batch, nll_loss)
    assert two["stats"]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["stats"]["nll_tokens"] == one["nll_tokens"] == one["n_tokens"]
    for name, value in engine.hf_state_dict().items():
        torch.testing.assert_close(two["params"][name], value, atol=1e-6, rtol=1e-5)

    engine.load_state(str(tmp_path / "state"))  # saved by two ranks, loaded by one
    for name, value in engine.hf_state_dict().items():
        assert torch.equal(value, two["params"][name]), name
    engine.destroy()


@pytest.mark.parametrize("overrides", [dict(gradient_checkpointing=True), dict(dtype="bfloat16")],
                         ids=["gradient_checkpointing", "bf16"])
def test_step_variants_train_every_parameter_and_keep_logprobs_close(tiny_path, overrides):
    reference = make_engine(tiny_path)
    expected = reference.compute_logprobs(make_batch())
    reference.destroy()
    spec = TrainEngineSpec(path=tiny_path, dtype="float32", optimizer=OptimizerConfig(lr=1e-3))
    engine = FSDPTrainEngine(dataclasses.replace(spec, **overrides), total_steps=10)
    engine.initialize()
    # bf16 compute: about 3 significant digits on log-probs of magnitude ~5.
    tolerance = 0.1 if overrides.get("dtype") == "bfloat16" else 1e-5
    torch.testing.assert_close(engine.compute_logprobs(make_batch()), expected,
                               atol=tolerance, rtol=0)
    before = engine.hf_state_dict()
    calls = []
    engine.model.hf.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    stats = engine.train_batch(make_batch(), nll_loss)
    after = engine.hf_state_dict()
    # Checkpointing runs each layer's forward again in backward.
    recomputed = 2 if overrides.get("gradient_checkpointing") else 1
    assert len(calls) == recomputed * stats["n_mbs"]
    assert all(v.dtype == torch.float32 for v in after.values())  # fp32 master weights
    assert not [name for name in before if torch.equal(before[name], after[name])]
    engine.destroy()


@pytest.mark.parametrize("overrides", [{}, {"gradient_checkpointing": True},
                                       {"shared_prefix": True}],
                         ids=["plain", "gradient_checkpointing", "shared_prefix"])
def test_one_rank_bf16_without_fsdp_equals_fsdp_bit_for_bit(tiny_path, monkeypatch, overrides):
    # One rank keeps bf16 copies of the fp32 masters instead of FSDP2's per-step gathers
    # (trainer/cpu/precision.py). Same casts, bf16 gradients summed in fp32 over micro-batches,
    # the tied embedding's two uses meeting in one copy: FSDP2's numbers exactly, over two
    # steps of four micro-batches each, an eval forward between them. (The tied embedding's
    # gradient sink is off here: it sums those two uses in fp32, the next test; so are the
    # clipping by the fused AdamW's scale, which FSDP's DTensors do not take: it divides
    # where clip_grads_with_norm_ multiplies, test_clipping_by_the_fused_optimizers_scale...;
    # and the AdamW in C that writes the copies, its FMAs rounding apart from torch's,
    # test_copying_adamw_in_the_engine...)
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * 320)
    set_cpu_paths(grads_to_master=False)
    set_cpu_paths(clip_in_optimizer=False)
    set_cpu_paths(norm_in_c=False)  # its sums round otherwise
    set_cpu_paths(write_copies_in_step=False)
    results = []
    for fsdp in (True, False):
        set_cpu_paths(fsdp_on_one_rank=fsdp)
        engine = make_engine(tiny_path, dtype="bfloat16", mb_spec=MicroBatchSpec(
            max_tokens_per_mb=12), optimizer=OptimizerConfig(lr=1e-2), **overrides)
        assert (engine._compute_weights is None) == fsdp
        stats = [engine.train_batch(make_batch(seed=0), nll_loss)]
        logprobs = engine.compute_logprobs(make_batch(seed=1))
        stats.append(engine.train_batch(make_batch(seed=1), nll_loss))
        results.append((stats, logprobs, engine.hf_state_dict()))
        engine.destroy()
    (fsdp_stats, fsdp_logprobs, fsdp_params), (stats, logprobs, params) = results
    assert [s["n_mbs"] for s in stats] == [4, 4]
    for ours, theirs in zip(stats, fsdp_stats):
        assert (ours["loss"], ours["grad_norm"]) == (theirs["loss"], theirs["grad_norm"])
    assert torch.equal(logprobs, fsdp_logprobs)
    assert all(v.dtype == torch.float32 for v in params.values())  # fp32 masters stepped
    for name, value in params.items():
        assert torch.equal(value, fsdp_params[name]), name


@pytest.mark.parametrize("overrides", [{}, {"shared_prefix": True}],
                         ids=["plain", "shared_prefix"])
@pytest.mark.parametrize("chunk, kept_bytes", [(3 * 320, 2 * 320 * 2 * 3), (10**6, 2**28)],
                         ids=["chunks_kept_and_recomputed", "one_chunk_kept"])
def test_tied_embedding_gradient_sink_changes_only_its_roundings(tiny_path, monkeypatch,
                                                                  overrides, chunk, kept_bytes):
    # With the sink the log-prob head and the input lookup add the tied embedding's
    # gradient into its fp32 master themselves. Every other gradient is the autograd
    # path's bit for bit; the embedding's differs only by the bf16 roundings of the sums
    # that path makes (head + lookup in bf16 per micro-batch). The tolerance is well below
    # the lookup's part: without it, or without the head's, the comparison fails.
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(logprob_head, "SAVED_TEMPLATE_BYTES", kept_bytes)
    grads = []
    for sink in (False, True):
        set_cpu_paths(grads_to_master=sink)
        engine = make_engine(tiny_path, dtype="bfloat16", mb_spec=MicroBatchSpec(
            max_tokens_per_mb=12), **overrides)
        assert engine._compute_weights is not None
        clip = engine._clip_gradients
        captured = {}

        def capture(engine=engine, clip=clip, captured=captured):
            captured.update({n: p.grad.clone() for n, p in engine.model.named_parameters()})
            return clip()

        monkeypatch.setattr(engine, "_clip_gradients", capture)
        engine.train_batch(make_batch(seed=0), nll_loss)
        grads.append(captured)
        embed = engine.model.hf.get_input_embeddings().weight
        names = {n for n, p in engine.model.named_parameters() if p is embed}
        engine.destroy()
    autograd, sunk = grads
    assert autograd.keys() == sunk.keys() and len(names) == 1
    (name,) = names
    for other in autograd.keys() - names:
        assert torch.equal(sunk[other], autograd[other]), other
    scale = autograd[name].abs().max()
    torch.testing.assert_close(sunk[name], autograd[name], rtol=2**-6, atol=float(scale) * 2**-8)


def test_init_from_scratch_ignores_the_saved_weights(tiny_path):
    pretrained = make_engine(tiny_path)
    scratch = make_engine(tiny_path, init_from_scratch=True)
    ours, theirs = pretrained.hf_state_dict(), scratch.hf_state_dict()
    assert ours.keys() == theirs.keys()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(ours[name], theirs[name])
    pretrained.destroy()
    scratch.destroy()


def test_a_model_with_dropout_is_refused_with_the_field_named(tmp_path):
    path = make_tiny_model(tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config_file.write_text(config_file.read_text().replace('"attention_dropout": 0.0',
                                                           '"attention_dropout": 0.1'))
    engine = FSDPTrainEngine(TrainEngineSpec(path=path), total_steps=1)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        engine.initialize()
    engine.destroy()


# ---- entropy, epochs and minibatches ----------------------------------------------------------

@pytest.mark.parametrize("logits_per_chunk", [2**25, 3 * 320], ids=["one_chunk", "3_per_chunk"])
def test_entropy_matches_a_full_softmax_over_the_vocabulary(tiny_path, monkeypatch,
                                                            logits_per_chunk):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", logits_per_chunk)
    engine = make_engine(tiny_path, temperature=0.7)
    batch = make_batch()
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # The reference: H = -sum_v p_v log p_v of softmax(logits / T), shifted so that position t
    # holds the entropy of the distribution token t was sampled from.
    logp = torch.log_softmax(logits[:, :-1] / 0.7, -1)
    expected = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) * batch.loss_mask
    targets = engine_module.targets_loss(batch)
    _, entropy = engine.model(batch.input_ids, batch.attention_mask, targets, with_entropy=True)
    torch.testing.assert_close(entropy.detach(), expected, atol=1e-5, rtol=1e-5)
    # The step reports the token mean over the loss tokens (of the weights before the step).
    stats = engine.train_batch(batch, nll_loss)
    mean = float(expected.sum() / batch.loss_mask.sum())
    assert stats["entropy"] == pytest.approx(mean, rel=1e-5)
    assert 0 < mean < math.log(320)  # below the uniform distribution's entropy
    engine.destroy()


def test_logprobs_with_entropy_equal_those_without(tiny_path, monkeypatch):
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", 3 * 320)  # recomputed chunks
    engine = make_engine(tiny_path)
    batch = make_batch()
    targets = engine_module.targets_loss(batch)
    weight = engine.model.hf.lm_head.weight
    results = []
    for with_entropy in (False, True):
        out = engine.model(batch.input_ids, batch.attention_mask, targets,
                           with_entropy=with_entropy)
        logprobs = out[0] if with_entropy else out
        logprobs.sum().backward()
        results.append((logprobs.detach(), weight.grad.clone()))
        weight.grad = None
    (plain, g_plain), (both, g_both) = results
    assert torch.equal(plain, both) and torch.equal(g_plain, g_both)
    engine.destroy()


def test_two_epochs_of_two_minibatches_take_four_optimiser_steps(tiny_path):
    engine = make_engine(tiny_path)
    seen = []

    def recording_loss(logprobs, mb, *, n_tokens, n_seqs):
        seen.append((int(mb.input_ids[0, 0]), n_seqs))
        return nll_loss(logprobs, mb, n_tokens=n_tokens, n_seqs=n_seqs)

    batch = make_batch()  # rows of 12, 7, 10, 5 tokens, 3 prompt tokens each
    stats = train_epochs(engine, batch, recording_loss, n_minibatches=2, epochs=2)
    assert engine.steps_done == 4 and stats["n_updates"] == 4
    # minibatches are rows [0, 1] and [2, 3], in that order in both epochs
    first = [int(batch.input_ids[0, 0]), int(batch.input_ids[2, 0])]
    assert [row for row, _ in seen] == first * 2 and {n for _, n in seen} == {2}
    # counts add up over the steps: 2 epochs * 22 loss tokens; other stats are step means:
    # nll_tokens is (9 + 4) for the first minibatch and (7 + 2) for the second, mean 11
    assert stats["n_tokens"] == 44 and stats["n_seqs"] == 8
    assert stats["nll_tokens"] == pytest.approx(11.0)
    engine.destroy()


def test_update_stats_merge_means_maxima_minima_and_counts():
    per_step = [
        {"loss": 1.0, "clip_frac": 0.1, "imp_weight_max": 3.0, "imp_weight_min": 0.5,
         "n_tokens": 10.0, "rejected_tokens": 1.0, "entropy": 2.0},
        {"loss": 3.0, "clip_frac": 0.3, "imp_weight_max": 2.0, "imp_weight_min": 0.4,
         "n_tokens": 12.0, "rejected_tokens": 0.0, "entropy": 1.0},
    ]
    assert merge_update_stats(per_step) == pytest.approx({
        "loss": 2.0, "clip_frac": 0.2, "imp_weight_max": 3.0, "imp_weight_min": 0.4,
        "n_tokens": 22.0, "rejected_tokens": 1.0, "entropy": 1.5, "n_updates": 2.0})


def test_minibatches_are_consecutive_rows_so_groups_stay_together():
    batch = make_batch(lengths=(4, 5, 6, 7, 8, 9, 10, 11))
    parts = split_minibatches(batch, 2)  # groups of 4: rows 0-3 and 4-7
    assert [p.seq_lens.tolist() for p in parts] == [[4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_rank_shown_one_gpu_uses_it_and_one_shown_all_takes_its_local_rank():
    from asyncrl.trainer.dist import gpu_index

    assert [gpu_index(r, 1) for r in range(4)] == [0, 0, 0, 0]  # CUDA_VISIBLE_DEVICES=<its id>
    assert [gpu_index(r, 8) for r in range(8)] == list(range(8))  # torchrun, all GPUs shown
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but only 2 GPU"):
        gpu_index(3, 2)


def test_adamw_state_taken_at_start_trains_exactly_as_taken_at_the_first_step(
        tiny_path, monkeypatch):
    # optim.init_state allocates what AdamW's first step would; nothing else may change.
    results = []
    for eager in (True, False):
        if not eager:
            monkeypatch.setattr(engine_module, "init_state", lambda optimizer: None)
        engine = make_engine(tiny_path)
        params = dict(engine.model.named_parameters())
        assert len(engine.optimizer.state) == (len(params) if eager else 0)
        for seed in (0, 1):
            engine.train_batch(make_batch(seed=seed), nll_loss)
        state = {n: dict(engine.optimizer.state[p]) for n, p in params.items()}
        results.append((engine.hf_state_dict(), state))
        engine.destroy()
    (weights, state), (lazy_weights, lazy_state) = results
    for name, value in weights.items():
        assert torch.equal(value, lazy_weights[name]), name
    for name, entries in state.items():
        assert entries.keys() == lazy_state[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in entries.items():
            other = lazy_state[name][key]
            assert (value.dtype, value.shape, value.device) == (other.dtype, other.shape,
                                                               other.device), (name, key)
            assert torch.equal(value, other), (name, key)


def test_the_masters_are_not_views_of_the_checkpoint_file(tiny_path):
    # transformers maps an fp32 checkpoint read as fp32; our copy drops the mapping.
    file = os.path.realpath(os.path.join(tiny_path, "model.safetensors"))
    engine = make_engine(tiny_path)
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if line.rstrip().endswith(file)]
    engine.destroy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clipping_by_the_fused_optimizers_scale_equals_clipping_the_gradients(tiny_path,
                                                                           monkeypatch, dtype):
    # Adam's first moment after one step is (1 - beta1) x the gradient it used: the clipped
    # one. Clipped by the fused AdamW's scale or in place first, the moments agree to fp32
    # roundings; both are the unclipped moments x max_norm / norm (a scale forgotten or
    # applied twice fails), and no scale is left behind for a later step.
    moments, norms = [], []
    for clip, in_optimizer in ((0.0, True), (1e-3, False), (1e-3, True)):
        set_cpu_paths(clip_in_optimizer=in_optimizer)
        engine = make_engine(tiny_path, dtype=dtype,
                             optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=clip))
        norms.append(engine.train_batch(make_batch(seed=0), nll_loss)["grad_norm"])
        assert engine.optimizer.grad_scale is None
        moments.append({n: engine.optimizer.state[p]["exp_avg"].clone()
                        for n, p in engine.model.named_parameters()})
        engine.destroy()
    (unclipped, in_place, scaled), coef = moments, 1e-3 / (norms[0] + 1e-6)
    assert norms[0] == norms[1] == norms[2] > 1e-3
    for name, m in unclipped.items():
        torch.testing.assert_close(scaled[name], in_place[name], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(scaled[name], m * coef, rtol=1e-5, atol=1e-12)


def test_copying_adamw_in_the_engine_keeps_the_copies_fresh_and_trains_as_torchs(
        tiny_path, monkeypatch):
    # On one rank in bf16 the step writes each master's compute copy itself: after every
    # step each copy is its master rounded to bf16 exactly (what the next forward reads, no
    # cast run). One step lands within fp32 roundings of torch's fused AdamW. (Later steps
    # drift further: a weight one fp32 rounding apart may round to another bf16 copy, and
    # Adam's normalised update turns the gradients' tiny differences into steps of lr.)
    runs = []
    for in_step in (True, False):
        set_cpu_paths(write_copies_in_step=in_step)
        engine = make_engine(tiny_path, dtype="bfloat16",
                             optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1))
        assert isinstance(engine.optimizer, optim.CopyingAdamW) == in_step
        before = engine.hf_state_dict()
        engine.train_batch(make_batch(seed=0), nll_loss)
        runs.append(engine.hf_state_dict())
        engine.train_batch(make_batch(seed=1), nll_loss)
        if in_step:
            pairs = list(engine._compute_weights._pairs.values())
            assert all(torch.equal(copy, master.to(torch.bfloat16))
                       for master, copy in pairs if master.requires_grad)
        engine.destroy()
    ours, theirs = runs
    for name in theirs:
        assert not torch.equal(theirs[name], before[name]), name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-8)


def test_publishing_writes_the_fresh_bf16_copies_without_casting_again(tiny_path, tmp_path):
    # After a CopyingAdamW step the copies are the bf16 weights: save_hf writes them
    # (a copy overwritten here shows in the file), equal to the masters cast to bf16.
    # Once the masters change under them (a state load), the masters are cast again.
    from safetensors.torch import load_file

    engine = make_engine(tiny_path, dtype="bfloat16")
    assert isinstance(engine.optimizer, optim.CopyingAdamW)
    engine.train_batch(make_batch(seed=0), nll_loss)
    engine.save_state(str(tmp_path / "state"))
    engine.save_hf(str(tmp_path / "a"), dtype=torch.bfloat16)
    masters = engine.hf_state_dict()
    written = load_file(tmp_path / "a" / "model.safetensors")
    assert written.keys() == masters.keys()
    for name, value in written.items():
        assert torch.equal(value, masters[name].to(torch.bfloat16)), name
    name = "model.layers.0.mlp.up_proj.weight"
    master = dict(engine.model.hf.named_parameters())[name]
    copy = engine._compute_weights._pairs[id(master)][1]
    copy.data.fill_(3.0)  # the copy stands for its master while it is fresh
    engine.save_hf(str(tmp_path / "b"), dtype=torch.bfloat16)
    assert bool((load_file(tmp_path / "b" / "model.safetensors")[name] == 3.0).all())
    engine.load_state(str(tmp_path / "state"))  # masters written: cast again
    engine.save_hf(str(tmp_path / "c"), dtype=torch.bfloat16)
    assert torch.equal(load_file(tmp_path / "c" / "model.safetensors")[name],
                       master.detach().to(torch.bfloat16))
    engine.destroy()
