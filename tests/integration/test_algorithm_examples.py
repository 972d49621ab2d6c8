"""Every algorithm's CPU example config runs two async steps on a tiny random model.

The config is the shipped YAML with only the model, the data and the sizes overridden, so
each algorithm's own settings (normalisation, aggregation, KL, critic, ...) are what runs.
"""

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "math"
CPU_CONFIGS = sorted(EXAMPLES.glob("gsm8k_*_cpu.yaml"))

# Stats that show the algorithm's own part ran, beyond the PPO loss every config has.
EXPECTED_STATS = {
    "gsm8k_reinforce_pp_cpu.yaml": ["train/kl_ref"],
    "gsm8k_dapo_cpu.yaml": ["rollout/groups_dropped", "rollout/groups_dropped_total"],
    "gsm8k_ppo_cpu.yaml": ["critic/loss", "critic/values_mean", "critic/explained_var"],
    "gsm8k_distill_cpu.yaml": ["train/distill_kl"],
}
# Sizes that must shrink with the test's 12-token budget.
EXTRA_OVERRIDES = {
    "gsm8k_dapo_cpu.yaml": ["actor.overlong_tokens=4"],
}
# Models the config names besides the actor: the tiny model stands in for them too.
MODEL_KEYS = {"gsm8k_distill_cpu.yaml": ["teacher.path"]}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.fixture(scope="module")
def toy_gsm8k(tmp_path_factory):
    """32 GSM8K-format rows (the configs' gsm8k reward and prompt format apply)."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n"
             f"#### {2 * i + 1}"} for i in range(32)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_algorithm_has_a_cpu_and_a_gpu_config():
    names = {p.name for p in EXAMPLES.glob("gsm8k_*.yaml")}
    assert len(CPU_CONFIGS) >= 6
    for cpu in CPU_CONFIGS:
        assert cpu.name.replace("_cpu", "") in names


# Every suite runs PPO (with its critic) here and GRPO's recipe in test_examples.py; the other
# recipes run with -m slow (their algorithms' end-to-end tests, test_dapo_e2e,
# test_distill_e2e, test_kl_e2e, run in every suite).
EVERY_SUITE = {"gsm8k_ppo_cpu.yaml"}


@pytest.mark.parametrize("config", [
    p if p.name in EVERY_SUITE else pytest.param(p, marks=pytest.mark.slow)
    for p in CPU_CONFIGS], ids=lambda p: p.stem)
def test_cpu_example_runs_two_async_steps(tmp_path, tiny_model, toy_gsm8k, config):
    cfg = load_config(config, [
        f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={tiny_model}",
        "actor.dtype=float32", "actor.optimizer.lr=1e-3", "local_engine.dtype=float32",
        "local_engine.max_batch_size=16", "local_engine.max_seq_len=256",
        "gconfig.max_new_tokens=12", f"train_dataset.path={toy_gsm8k}",
        "train_dataset.batch_size=2", "total_train_steps=2", "valid_dataset=null",
        # A tiny random model never solves GSM8K: a reward that differs between completions.
        "workflow.reward_fn=toy_rewards:text_hash", "workflow.system_prompt=null",
        "stats_logger.progress_bar=false", "stats_logger.plot=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1",
        *EXTRA_OVERRIDES.get(config.name, []),
        *(f"{key}={tiny_model}" for key in MODEL_KEYS.get(config.name, [])),
    ])
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl")
            if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["train/entropy"] > 0
        assert r["rollout/staleness_max"] <= cfg.rollout.max_head_offpolicyness
        for key in EXPECTED_STATS.get(config.name, []):
            assert key in r, f"{config.name}: {key} missing from the step's stats"
