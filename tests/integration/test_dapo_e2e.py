"""DAPO end to end: 2 async steps on a tiny model with dynamic sampling and its companions.

Dynamic sampling (rollout side) + clip-higher + token-mean + the soft overlong penalty, with
2 epochs of 2 minibatches and sequence-level rejection sampling, so the recomputed proximal
log-probs, the merged update stats and the dropped-group counters all show in stats.jsonl.
"""

from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def test_dapo_drops_equal_reward_groups_and_trains_two_steps(tmp_path, tiny_model):
    cfg = tiny_run_config(
        tmp_path, tiny_model, "trial_name=t", "rollout.dynamic_sampling=true",
        "actor.eps_clip=0.2", "actor.eps_clip_higher=0.28", "actor.loss_agg_mode=token-mean",
        "actor.overlong_reward_penalty=true", "actor.overlong_tokens=4",
        "actor.ppo_n_minibatches=2", "actor.ppo_epochs=2",
        "actor.behav_imp_weight_cap=null", "actor.rejection_sampling.level=sequence",
        "actor.rejection_sampling.upper=2.0",
        # three items in four get reward 0 for every sample: their groups are dropped
        "workflow.reward_fn=toy_rewards:hash_or_constant", name="dapo")
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    totals = [r["rollout/groups_dropped_total"] for r in rows]
    assert sum(r["rollout/groups_dropped"] for r in rows) == totals[-1] > 0
    assert totals == sorted(totals)  # cumulative
    for r in rows:
        # kept groups are text_hash groups: rewards in (0, 1) that differ within the group
        assert 0 < r["rollout/reward"] < 1
        assert r["rollout/episodes_accepted"] >= 2 * r["step"]
        assert r["train/n_updates"] == 4  # 2 epochs x 2 minibatches
        assert r["train/entropy"] > 0
        assert r["train/imp_weight_min"] <= r["train/imp_weight_mean"] <= r["train/imp_weight_max"]
        for key in ("clip_frac", "rejected_frac", "clamped_frac"):
            assert r[f"train/{key}"] >= 0
        for key in ("approx_kl", "behav_kl"):  # k3 >= 0, up to float32 rounding near 0
            assert r[f"train/{key}"] >= -1e-6
        assert r["train/grad_norm"] > 0
