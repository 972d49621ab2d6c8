"""The CPU twins of the big GPU recipes (examples/big/*_cpu.yaml) run two async steps as
shipped, on their named tiny random models, with only the data, the sizes and the reward
overridden (a random model never solves GSM8K)."""

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.observe import read_stats

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~50 s each on 2 cores
BIG = Path(__file__).resolve().parents[2] / "examples" / "big"
TWINS = sorted(BIG.glob("*_cpu.yaml"))
# Stats that show the recipe's own part ran.
EXPECTED_STATS = {"qwen3_30b_a3b_grpo_cpu.yaml": ["train/router_aux_loss"]}


@pytest.fixture(scope="module")
def toy_gsm8k(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}
            for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("config", TWINS, ids=lambda p: p.stem)
def test_cpu_twin_runs_two_async_steps(tmp_path, toy_gsm8k, config, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))  # the tiny model's folder
    cfg = load_config(config, [
        f"cluster.fileroot={tmp_path / 'runs'}", f"train_dataset.path={toy_gsm8k}",
        "train_dataset.batch_size=2", "total_train_steps=2", "gconfig.max_new_tokens=12",
        "local_engine.max_seq_len=256", "workflow.reward_fn=toy_rewards:text_hash",
        "workflow.system_prompt=null", "stats_logger.progress_bar=false",
        "stats_logger.plot=false", "scheduler.inference_threads=1",
        "scheduler.trainer_threads=1",
    ])
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl")
            if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["train/entropy"] > 0
        assert r["rollout/staleness_max"] <= cfg.rollout.max_head_offpolicyness
        for key in EXPECTED_STATS.get(config.name, []):
            assert r[key] > 0, f"{config.name}: {key}"
