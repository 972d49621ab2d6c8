"""A reward model as the RL reward: 2 async steps on a tiny model, scored in worker processes."""

from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.reward import load_reward_model
from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer
from asyncrl.observe import read_stats
from asyncrl.rewards.reward_model import RewardModelScorer

pytestmark = pytest.mark.integration


def test_rl_with_a_reward_model_as_the_reward_function(tmp_path):
    policy = make_tiny_model(tmp_path / "policy")
    rm_dir = tmp_path / "rm"  # an untrained reward model: a fresh head, real scores
    load_reward_model(make_tiny_model(tmp_path / "rm_base", seed=3)).save_pretrained(rm_dir)
    make_tiny_tokenizer().save_pretrained(rm_dir)
    cfg = tiny_run_config(
        tmp_path, policy, "workflow.reward_fn=reward_model",
        f"workflow.reward_model_path={rm_dir}", "workflow.reward_timeout=60",
        "evaluator.after_training=true",
        "valid_dataset.path=reasoning_gym:basic_arithmetic", "valid_dataset.size=2",
        "valid_dataset.seed=99", name="rm_reward")
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
