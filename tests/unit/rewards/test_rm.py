"""Reward models: the Bradley-Terry loss by hand, preference rows, the engine, the trainer on a
toy preference, and the trained model as an RL reward function."""

import json
import math
import pickle
import re

import pytest
import torch

from asyncrl.algorithms import bradley_terry_loss, make_bradley_terry_loss_fn
from asyncrl.cli import main as cli_main
from asyncrl.config import ConfigError, load_config
from asyncrl.config.offline import OfflineDatasetConfig, RMConfig, TrainEngineConfig
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.data.loading import DatasetError
from asyncrl.data.offline import (
    TokenRow,
    collate,
    last_token_row,
    load_preference_examples,
    preference_conversations,
)
from asyncrl.models.reward import encode_conversation
from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer
from asyncrl.observe import read_stats
from asyncrl.rewards import RewardRunner, resolve_reward_fn
from asyncrl.rewards.reward_model import RewardModelScorer

# ---- the Bradley-Terry loss ---------------------------------------------------------------

# r_chosen [2, 0, 1], r_rejected [0, 0, 3]: margins [2, 0, -2].
# -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147;
# -log sigmoid(-2) = log(1 + e^2) = 2.126928. Mean over 3 pairs: 2.947003 / 3 = 0.982334.
BT_TERMS = [math.log1p(math.exp(-2)), math.log(2), math.log1p(math.exp(2))]


def test_bradley_terry_loss_accuracy_and_gradient_by_hand():
    chosen = torch.tensor([2.0, 0.0, 1.0], requires_grad=True)
    loss, stats = bradley_terry_loss(chosen, torch.tensor([0.0, 0.0, 3.0]), n_pairs=3)
    assert float(loss.detach()) == pytest.approx(sum(BT_TERMS) / 3) == pytest.approx(0.982334)
    # The tie (margin 0) is not a correct ranking: 1 of 3.
    assert stats == pytest.approx({"accuracy": 1 / 3, "margin": 0.0, "chosen_reward": 1.0,
                                   "rejected_reward": 1.0})
    loss.backward()
    # d/dr_c -log sigmoid(m) = -sigmoid(-m): [-0.119203, -0.5, -0.880797] / 3.
    sig = [1 / (1 + math.exp(2)), 0.5, 1 / (1 + math.exp(-2))]
    torch.testing.assert_close(chosen.grad, -torch.tensor(sig) / 3)


def test_bradley_terry_micro_batch_shares_add_up_to_the_batch_loss():
    fn = make_bradley_terry_loss_fn()
    # The engine's [B, T] output: each row's reward on one token, rows (c, r) pairs.
    out = torch.tensor([[0, 2.0], [0, 0], [0, 0], [0, 0], [1, 0], [3, 0]])
    whole, _ = fn(out, None, n_tokens=6, n_seqs=6)
    first, _ = fn(out[:2], None, n_tokens=6, n_seqs=6)
    rest, _ = fn(out[2:], None, n_tokens=6, n_seqs=6)
    assert float(whole) == pytest.approx(sum(BT_TERMS) / 3)
    assert float(first + rest) == pytest.approx(float(whole))
    with pytest.raises(ValueError, match="pairs; got 3 rows"):
        fn(out[:3], None, n_tokens=6, n_seqs=6)


# ---- preference rows (the parser DPO uses; the RM's loss mask on the last token) ----------

def rows(row):
    """The (chosen, rejected) conversations the shared parser makes of `row`."""
    chosen, rejected, _ = preference_conversations(row, system_prompt=None)
    return chosen, rejected


def test_rows_as_strings_chat_lists_or_whole_conversations():
    user, good, bad = "2+2?", "4", "5"
    as_strings = rows({"prompt": user, "chosen": good, "rejected": bad})
    expected = ([{"role": "user", "content": user}, {"role": "assistant", "content": good}],
                [{"role": "user", "content": user}, {"role": "assistant", "content": bad}])
    assert as_strings == expected
    chat = {"prompt": [{"role": "user", "content": user}],
            "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}
    assert rows(chat) == expected
    assert rows({"chosen": expected[0], "rejected": expected[1]}) == expected
    with pytest.raises(ValueError, match="whole conversations"):
        rows({"chosen": good, "rejected": bad})
    with pytest.raises(ValueError, match=r"chosen\[0\] has role 'bot'"):
        rows({"prompt": user, "chosen": [{"role": "bot", "content": good}], "rejected": bad})


def test_whole_conversations_share_their_common_first_messages_as_the_prompt():
    # TRL's implicit prompt: [user, assistant, user] is common, the last turns differ.
    head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"}]
    row = {"chosen": head + [{"role": "assistant", "content": "4"}],
           "rejected": head + [{"role": "assistant", "content": "5"}]}
    assert preference_conversations(row, None)[2] == 3
    # A side that only repeats the shared turns has no answer to compare.
    with pytest.raises(ValueError, match="'rejected' has no assistant message after the 3"):
        preference_conversations({"chosen": row["chosen"], "rejected": head}, None)


def test_a_bad_row_names_its_file_and_line(tmp_path, caplog):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(DatasetError, match=r"prefs.jsonl:2: missing \['rejected'\]"):
        load_preference_examples(OfflineDatasetConfig(path=str(path), bad_rows="error"),
                                 make_tiny_tokenizer(), to_row=last_token_row)
    with caplog.at_level("WARNING"):  # by default: left out, and named in one warning
        pairs = load_preference_examples(OfflineDatasetConfig(path=str(path)),
                                         make_tiny_tokenizer(), to_row=last_token_row)
    assert len(pairs) == 1
    assert re.search(r"skipped 1 malformed row\(s\) \(.*prefs.jsonl:2: missing \['rejected'\]",
                     caplog.text)


def test_rm_rows_are_the_rl_scorers_tokens_with_the_last_one_marked(tmp_path):
    tok = make_tiny_tokenizer()
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "five"}) + "\n")
    [(chosen, rejected)] = load_preference_examples(OfflineDatasetConfig(path=str(path)), tok,
                                                    to_row=last_token_row)
    # RL scores [user: question, assistant: completion] with encode_conversation.
    for row, answer in ((chosen, "4"), (rejected, "five")):
        ids = encode_conversation(tok, [{"role": "user", "content": "2+2?"},
                                        {"role": "assistant", "content": answer}])
        assert row.input_ids == ids
        assert row.loss_mask == [0] * (len(ids) - 1) + [1]
    # "five" is 3 bytes (tokens) longer than "4".
    assert len(rejected.input_ids) == len(chosen.input_ids) + 3
    assert (chosen.label, rejected.label) == (1.0, 0.0)


def test_pairs_collate_interleaved_with_the_last_real_token_marked():
    pairs = [([5, 6, 7], [5, 8]), ([9], [9, 9, 9, 9])]
    batch = collate([TokenRow(ids, [0] * (len(ids) - 1) + [1]) for p in pairs for ids in p],
                    pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [9, 0, 0, 0], [9, 9, 9, 9]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]


# ---- config -------------------------------------------------------------------------------

def test_rm_config_names_bad_keys():
    cfg = load_config(None, ["train_dataset.path=p.jsonl", "model.path=/m"], schema=RMConfig)
    assert cfg.tokenizer_path == "/m" and cfg.valid_dataset is None
    assert cfg.model.mb_spec.granularity == 2  # (chosen, rejected) share a micro-batch
    with pytest.raises(ConfigError,
                       match=r"granularity=3 would split .*\(reward-model training sets 2\)"):
        load_config(None, ["train_dataset.path=p", "model.mb_spec.granularity=3"],
                    schema=RMConfig)
    with pytest.raises(ConfigError, match="format=chat is not a reward-model format"):
        load_config(None, ["train_dataset.path=p", "train_dataset.format=chat"], schema=RMConfig)
    with pytest.raises(ConfigError, match="train_dataset.path is empty"):
        load_config(None, [], schema=RMConfig)
    with pytest.raises(ConfigError, match="valid_dataset.batch_size must be >= 1"):
        load_config(None, ["train_dataset.path=p", "valid_dataset.path=v",
                           "valid_dataset.batch_size=0"], schema=RMConfig)
    with pytest.raises(ConfigError, match="did you mean 'train_dataset.batch_size'"):
        load_config(None, ["train_dataset.path=p", "train_dataset.batchsize=2"], schema=RMConfig)


def test_reward_model_reward_needs_its_path_and_only_with_it():
    base = ["train_dataset.path=x.jsonl"]
    with pytest.raises(ConfigError, match="reward_fn=reward_model needs workflow.reward_model"):
        load_config(None, [*base, "workflow.reward_fn=reward_model"])
    with pytest.raises(ConfigError, match="reward_model_path is set but workflow.reward_fn="):
        load_config(None, [*base, "workflow.reward_model_path=/rm"])
    with pytest.raises(ValueError, match="needs workflow.reward_model_path"):
        resolve_reward_fn("reward_model")


def test_a_causal_lm_is_not_taken_for_a_reward_model(tmp_path):
    lm = make_tiny_model(tmp_path / "lm")  # HF's default config has num_labels=2
    with pytest.raises(ValueError, match="num_labels=2; give a reward model"):
        RewardModelScorer(lm)


# ---- training a reward model, then scoring with it -----------------------------------------

def _write_pairs(path, words):
    # Trivially separable: the preferred answer is always "good ...", the other "bad ...".
    with open(path, "w") as f:
        for w in words:
            f.write(json.dumps({"prompt": f"Tell me about {w}.", "chosen": f"good {w}",
                                "rejected": f"bad {w}"}) + "\n")


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rm")
    model = make_tiny_model(root / "tiny")
    _write_pairs(root / "train.jsonl", [f"topic{i}" for i in range(24)])
    _write_pairs(root / "valid.jsonl", ["apples", "rivers", "stars", "maths", "music", "tea"])
    rc = cli_main(["rm", f"model.path={model}", "model.dtype=float32",
                   "model.optimizer.lr=3e-3", f"cluster.fileroot={root / 'runs'}",
                   f"train_dataset.path={root / 'train.jsonl'}", "train_dataset.batch_size=8",
                   f"valid_dataset.path={root / 'valid.jsonl'}", "total_train_epochs=6",
                   "stats_logger.tensorboard=false"])
    assert rc == 0
    [run] = (root / "runs" / "asyncrl-rm").iterdir()
    return run


def test_the_rm_trainer_learns_a_separable_toy_preference(trained_rm):
    rows = read_stats(trained_rm / "stats.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in evals] == [0, 18] and len(train) == 18  # 3 steps x 6 epochs
    before, after = evals[0], evals[-1]
    assert after["eval/accuracy"] == 1.0 and after["eval/loss"] < before["eval/loss"] / 2
    assert after["eval/margin"] > 1.0
    assert train[0]["train/n_seqs"] == 16  # 8 pairs, both rows of each


def test_the_saved_rm_scores_in_rl_as_a_direct_hf_forward_does(trained_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = trained_rm / "checkpoints" / "step18"
    scorer = RewardModelScorer(str(model_dir))
    item = {"id": "q", "question": "Tell me about clouds."}
    good, bad = scorer("good clouds", item), scorer("bad clouds", item)
    assert good > bad  # a held-out topic, ranked as trained

    # HF's own pooling (last non-pad token via config.pad_token_id) on the same rendering.
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    assert hf.config.architectures == ["LlamaForSequenceClassification"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = encode_conversation(tok, [{"role": "user", "content": item["question"]},
                                    {"role": "assistant", "content": "good clouds"}])
    with torch.no_grad():
        direct = float(hf(input_ids=torch.tensor([ids])).logits[0, 0])
    assert good == pytest.approx(direct, abs=1e-5)
    # Batched with padding: the same numbers.
    assert scorer.score_batch([("good clouds", item), ("bad", item)]) == pytest.approx(
        [good, scorer("bad", item)], abs=1e-5)
    # As the reward runner ships it to a worker: only the path travels.
    clone = pickle.loads(pickle.dumps(scorer))
    assert clone("good clouds", item) == pytest.approx(good)


def test_the_rm_reward_runs_in_the_reward_runner_and_surfaces_errors(trained_rm):
    import asyncio

    scorer = resolve_reward_fn("reward_model",
                               reward_model_path=str(trained_rm / "checkpoints" / "step18"))
    runner = RewardRunner(scorer, timeout=60, processes=False)
    try:
        item = {"id": "q", "question": "Tell me about clouds."}
        assert asyncio.run(runner.score("good clouds", item)) == pytest.approx(
            scorer("good clouds", item))
        with pytest.raises(Exception, match="no 'question' string"):
            asyncio.run(runner.score("good", {"id": "x"}))
    finally:
        runner.close()


def make_rm_engine(path, budget, granularity=2, **kw):
    from asyncrl.trainer import FSDPRewardEngine

    cfg = TrainEngineConfig(path=path, dtype="float32", mb_spec=MicroBatchSpec(
        max_tokens_per_mb=budget, granularity=granularity), optimizer=OptimizerConfig(lr=1e-3))
    return FSDPRewardEngine(cfg.engine_spec(device="cpu"), total_steps=1, **kw)


def test_micro_batches_keep_pairs_whole_and_add_up_to_one_big_batch(tmp_path):
    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path / "tiny")
    pairs = [([5] * 6, [6] * 3), ([7] * 2, [8] * 5), ([9] * 4, [9] * 4)]
    batch = collate([TokenRow(ids, [0] * (len(ids) - 1) + [1]) for p in pairs for ids in p], 0)
    results = []
    for budget in (1000, 10):
        engine = make_rm_engine(path, budget)
        engine.initialize()
        plan = engine._my_micro_batches(batch)
        results.append((plan, engine.train_batch(batch, make_bradley_terry_loss_fn())))
        engine.destroy()
    (one_plan, one), (many_plan, many) = results
    assert one_plan == [([0, 1, 2, 3, 4, 5], True)]
    # Budget 10 -> 5 per pair: pairs (as long as their longer row) 6, 5, 4 each go alone.
    assert many_plan == [([0, 1], True), ([2, 3], True), ([4, 5], True)]
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert many["accuracy"] == one["accuracy"] and many["grad_norm"] == pytest.approx(
        one["grad_norm"], rel=1e-4)
    # Without pair granularity, rows sorted by length would pair the wrong rows: refused.
    with pytest.raises(ValueError, match="granularity=1: a reward model trains on"):
        make_rm_engine(path, 10, granularity=1)


def test_the_system_prompt_rm_training_uses_is_the_one_rl_scoring_uses(tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    tok, system = make_tiny_tokenizer(), "Judge the answer."
    path = make_tiny_model(tmp_path / "tiny")
    engine = make_rm_engine(path, 1000, system_prompt=system)
    engine.initialize()
    engine.save_hf(str(tmp_path / "rm"))
    engine.destroy()
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    [(chosen, _)] = load_preference_examples(OfflineDatasetConfig(path=str(data)), tok,
                                             system_prompt=system, to_row=last_token_row)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    with torch.no_grad():
        trained_on = float(hf(input_ids=torch.tensor([chosen.input_ids])).logits[0, 0])
    scorer = RewardModelScorer(str(tmp_path / "rm"))
    item = {"id": "q", "question": "2+2?"}
    assert scorer("4", item) == pytest.approx(trained_on, abs=1e-5)
    # Without the system turn the tokens, and so the score, would differ.
    bare = encode_conversation(tok, [{"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4"}])
    with torch.no_grad():
        unprompted = float(hf(input_ids=torch.tensor([bare])).logits[0, 0])
    assert scorer("4", item) != pytest.approx(unprompted, abs=1e-4)
