"""Offline training on the engine: pairs kept in micro-batches, reference log-probs once, epochs."""

import dataclasses

import pytest
import torch

from asyncrl.algorithms import make_dpo_loss_fn, make_sft_loss_fn
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.data.offline import TokenRow, collate
from asyncrl.offline.dpo import compute_reference_logprobs
from asyncrl.offline.loop import epoch_batches, evaluate
from asyncrl.trainer import FSDPTrainEngine, plan_micro_batches

pytestmark = pytest.mark.usefixtures("process_group")


# -- the micro-batch planner with granularity -------------------------------------------


def test_granularity_keeps_consecutive_rows_together_and_in_order():
    lengths = [5, 9, 3, 3, 8, 2]  # units (0, 1) width 9, (2, 3) width 3, (4, 5) width 8
    # Budget 12: a unit of 2 rows may join a micro-batch while k * width <= 12 // 2 = 6, so
    # the width-9 and width-8 units are alone and (2, 3) (2 rows * 3 = 6 tokens) too.
    assert plan_micro_batches(lengths, 12, 1, granularity=2) == [[[0, 1], [4, 5], [2, 3]]]
    # Budget 40: 2 units * 2 rows * width 9 = 36 <= 40; a third would pad to 54.
    assert plan_micro_batches(lengths, 40, 1, granularity=2) == [[[0, 1, 4, 5], [2, 3]]]
    # Without granularity the same budget tears the pairs apart (sorted by length).
    assert plan_micro_batches(lengths, 12, 1) == [[[1], [4], [0, 2], [3, 5]]]


def test_granularity_keeps_units_whole_across_ranks():
    # Unit loads (sums of lengths): 14, 6, 10 -> rank 0 gets 14, rank 1 gets 10 then 6;
    # rank 1's micro-batch lists its units widest first: (4, 5) width 8, then (2, 3).
    plans = plan_micro_batches([5, 9, 3, 3, 8, 2], 1000, 2, granularity=2)
    assert plans == [[[0, 1]], [[4, 5, 2, 3]]]


def test_granularity_refuses_a_batch_of_partial_units():
    with pytest.raises(ValueError, match="granularity=2"):
        plan_micro_batches([5, 9, 3], 100, 1, granularity=2)


# -- the engine with the SFT and DPO losses ---------------------------------------------


def make_engine(path, max_tokens=10_000, granularity=1) -> FSDPTrainEngine:
    # eps = 1: Adam's first step is ~lr * grad, so parameters also compare gradient scales.
    spec = TrainEngineSpec(path=path, dtype="float32",
                           optimizer=OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0),
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens,
                                                  granularity=granularity))
    engine = FSDPTrainEngine(spec, total_steps=10)
    engine.initialize()
    return engine


def pair_rows(seed=0):
    """Three (chosen, rejected) pairs of different lengths, 3 prompt tokens each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (14, 6, 11, 9, 5, 12):
        ids = torch.randint(3, 250, (length,), generator=g).tolist()
        rows.append(TokenRow(input_ids=ids, loss_mask=[0, 0, 0] + [1] * (length - 3),
                             label=float(len(rows) % 2 == 0),
                             ref_logprobs=-torch.rand(length, generator=g) * 8))
    return rows


def test_sft_step_reports_the_nll_of_answer_tokens_only(tiny_path):
    engine = make_engine(tiny_path)
    rows = pair_rows()
    batch = collate(rows, 0)
    before = engine.compute_logprobs(batch)
    stats = engine.train_batch(batch, make_sft_loss_fn())
    # The loss read before the step: -sum of answer-token log-probs / their count (39 tokens:
    # lengths 14 + 6 + 11 + 9 + 5 + 12 = 57, minus 3 prompt tokens per row).
    answer = batch.loss_mask > 0
    assert stats["n_tokens"] == 57 - 18
    assert stats["loss"] == pytest.approx(float(-before[answer].sum() / 39), rel=1e-5)
    engine.destroy()


def test_dpo_step_with_many_micro_batches_equals_one_micro_batch(tiny_path):
    loss_fn = make_dpo_loss_fn(beta=0.5)
    results = []
    for max_tokens in (10_000, 24):  # 24 tokens: one pair per micro-batch
        engine = make_engine(tiny_path, max_tokens, granularity=2)
        stats = engine.train_batch(collate(pair_rows(), 0), loss_fn)
        results.append((stats, engine.hf_state_dict()))
        engine.destroy()
    (one, params_one), (many, params_many) = results
    assert one["n_mbs"] == 1 and many["n_mbs"] == 3
    for key in ("loss", "reward_margin", "reward_accuracy", "chosen_logp", "grad_norm"):
        assert many[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    for name in params_one:
        torch.testing.assert_close(params_many[name], params_one[name], atol=1e-6, rtol=1e-5)


def test_dpo_without_granularity_is_refused_when_pairs_would_split(tiny_path):
    engine = make_engine(tiny_path, max_tokens=24)
    with pytest.raises(ValueError, match="pairs"):
        engine.train_batch(collate(pair_rows(), 0), make_dpo_loss_fn(beta=0.5))
    engine.destroy()


def test_evaluate_treats_the_held_out_set_as_one_batch(tiny_path):
    engine = make_engine(tiny_path)
    rows = pair_rows()
    examples = [rows[i:i + 2] for i in (0, 2, 4)]
    loss_fn = make_dpo_loss_fn(beta=0.5)
    whole = evaluate(engine, examples, loss_fn, batch_size=3, pad_token_id=0)
    chunked = evaluate(engine, examples, loss_fn, batch_size=1, pad_token_id=0)
    assert chunked == pytest.approx(whole, rel=1e-5)
    batch = collate(rows, 0)
    expected, _ = loss_fn(engine.compute_logprobs(batch), batch, n_tokens=39, n_seqs=6)
    assert whole["loss"] == pytest.approx(float(expected), rel=1e-6)
    engine.destroy()


# -- reference log-probs: one pass, then freed ------------------------------------------


class CountingEngine:
    """A stand-in reference engine: log-prob = -(token id) / 100, counting its calls."""

    def __init__(self):
        self.calls = {"initialize": 0, "compute_logprobs": 0, "destroy": 0}
        self.batch_rows = []

    def initialize(self):
        self.calls["initialize"] += 1

    def compute_logprobs(self, batch):
        self.calls["compute_logprobs"] += 1
        self.batch_rows.append(len(batch))
        return -batch.input_ids.float() / 100 * batch.attention_mask

    def destroy(self):
        self.calls["destroy"] += 1


def test_reference_logprobs_are_computed_once_per_row_then_the_engine_is_freed():
    rows = [TokenRow(input_ids=list(range(1, n + 1)), loss_mask=[0] + [1] * (n - 1))
            for n in (3, 5, 2, 4, 6, 2, 3)]
    examples = [rows[0:2], rows[2:4], rows[4:6], rows[6:]]  # 3 pairs and a single row
    engine = CountingEngine()
    compute_reference_logprobs(engine, examples, batch_size=3, pad_token_id=0)
    # 4 examples in chunks of 3: 2 forwards (6 rows, then 1).
    assert engine.calls == {"initialize": 1, "compute_logprobs": 2, "destroy": 1}
    assert engine.batch_rows == [6, 1]
    for row in rows:  # trimmed to the row, not the padded width: ids 1..n -> -0.01 .. -n/100
        expected = -torch.arange(1, len(row.input_ids) + 1, dtype=torch.float32) / 100
        torch.testing.assert_close(row.ref_logprobs, expected)


# -- epochs ----------------------------------------------------------------------------


def test_each_epoch_is_one_shuffled_pass_and_the_seed_fixes_the_order():
    batches = epoch_batches(5, 2, shuffle=True, seed=3)
    epochs = [[next(batches) for _ in range(3)] for _ in range(3)]  # ceil(5 / 2) = 3 batches
    for epoch in epochs:
        assert [len(b) for b in epoch] == [2, 2, 1]
        assert sorted(i for b in epoch for i in b) == [0, 1, 2, 3, 4]
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled
    again = epoch_batches(5, 2, shuffle=True, seed=3)
    assert [next(again) for _ in range(9)] == [b for e in epochs for b in e]
    plain = epoch_batches(5, 2, shuffle=False, seed=3)
    assert [next(plain) for _ in range(3)] == [[0, 1], [2, 3], [4]]


def test_engine_config_of_the_model_section_keeps_its_keys():
    from asyncrl.config.offline import TrainEngineConfig

    model = TrainEngineConfig(path="p", dtype="float32", gradient_checkpointing=True,
                              mb_spec=MicroBatchSpec(max_tokens_per_mb=7, granularity=2),
                              optimizer=OptimizerConfig(lr=3e-4))
    cfg = model.engine_spec(device="cpu")
    assert (cfg.path, cfg.dtype, cfg.gradient_checkpointing) == ("p", "float32", True)
    assert dataclasses.astuple(cfg.mb_spec) == (7, 2) and cfg.optimizer.lr == 3e-4
    assert cfg.temperature == 1.0  # SFT/DPO log-probs are the model's own distribution
