"""PPO with a critic end to end: 2 async steps on a tiny model, saved, then resumed for a third."""

import math
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration


def _config(tmp_path, model, steps):
    return tiny_run_config(
        tmp_path, model, "trial_name=ppo",
        "actor.discount=1.0", "actor.gae_lambda=0.95", "actor.reward_norm=null",
        "actor.ppo_n_minibatches=2",  # the critic's too: its 2nd minibatch sees moved values
        "critic.dtype=float32", "critic.optimizer.lr=1e-3", "critic.eps_clip=0.2",
        f"total_train_steps={steps}", "saver.freq_steps=2", "recover.mode=auto",
        "recover.freq_steps=1", name="critic")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def test_ppo_with_a_critic_trains_saves_and_resumes_the_value_model(tmp_path, tiny_model):
    from transformers import AutoModelForTokenClassification

    train(_config(tmp_path, tiny_model, steps=2))
    summary = train(_config(tmp_path, tiny_model, steps=3))  # resumes at step 3
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["critic/grad_norm"] > 0 and r["train/grad_norm"] > 0
        assert math.isfinite(r["critic/loss"]) and 0.0 <= r["critic/clip_frac"] <= 1.0
        # text_hash rewards lie in [0, 1) and land on the last token (gamma 1): the
        # returns are near them, the fresh head's values near 0.
        assert -1.0 < r["critic/returns_mean"] < 2.0
        # 4 rows (2 prompts x 2 samples) in 2 minibatches: their row counts add up to 4.
        assert {"critic/values_mean", "critic/lr"} <= set(r) and r["critic/n_seqs"] == 4
        assert r["critic/n_updates"] == 2
    # The fresh head predicts about -0.13 on these rows; two steps towards returns of ~0.4
    # moved it up. A resume that lost the critic would start from the fresh head again.
    assert rows[2]["critic/values_mean"] > rows[0]["critic/values_mean"] + 0.2
    assert (run / "recover" / "critic" / ".metadata").is_file()
    critic = AutoModelForTokenClassification.from_pretrained(run / "checkpoints" / "step2_critic")
    assert critic.config.num_labels == 1
    ids = torch.tensor([[5, 6, 7]])
    assert torch.isfinite(critic(input_ids=ids).logits).all()
