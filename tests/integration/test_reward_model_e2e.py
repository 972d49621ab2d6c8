"""A reward model as the RL reward: 2 async steps on a tiny model, scored in worker processes."""

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.models.reward import load_reward_model
from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer
from asyncrl.observe import read_stats
from asyncrl.rewards.reward_model import RewardModelScorer
from asyncrl.trainers.rl import train

pytestmark = pytest.mark.integration


def test_rl_with_a_reward_model_as_the_reward_function(tmp_path):
    policy = make_tiny_model(tmp_path / "policy")
    rm_dir = tmp_path / "rm"  # an untrained reward model: a fresh head, real scores
    load_reward_model(make_tiny_model(tmp_path / "rm_base", seed=3)).save_pretrained(rm_dir)
    make_tiny_tokenizer().save_pretrained(rm_dir)
    cfg = load_config(None, [
        "experiment_name=rm_reward", f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.path={policy}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
        "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "local_engine.max_seq_len=256", "gconfig.n_samples=2", "gconfig.max_new_tokens=12",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=64",
        "train_dataset.batch_size=2", "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=1", "total_train_steps=2",
        "workflow.reward_fn=reward_model", f"workflow.reward_model_path={rm_dir}",
        "workflow.reward_timeout=60", "stats_logger.progress_bar=false",
        "stats_logger.plot=false", "evaluator.before_training=false",
        "valid_dataset.path=reasoning_gym:basic_arithmetic", "valid_dataset.size=2",
        "valid_dataset.seed=99",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1",
    ])
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/episodes_failed"] == 0 and r["train/grad_norm"] > 0 for r in rows)
    # The rewards the workers gave are the reward model's scores of question + completion.
    scorer = RewardModelScorer(str(rm_dir))
    samples = read_stats(run / "eval" / "step2.jsonl")
    assert len(samples) == 2
    for s in samples:
        item = {"id": s["task_id"], "question": s["question"]}
        assert s["reward"] == pytest.approx(scorer(s["completion"], item), abs=1e-5)
