"""The code RL examples: the CPU recipe runs two async steps on a tiny random model with
the sandboxed code reward, and the GPU recipe builds its workflow without downloads."""

import importlib
import json
from pathlib import Path

import pytest

from asyncrl.agents.code_reward import DEFAULT_LIMITS, code_reward
from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.controller.workflows import RLVRWorkflow
from asyncrl.data.code_tasks import held_out_tasks
from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer
from asyncrl.observe import read_stats
from asyncrl.rewards.registry import resolve_reward_fn

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "code"


@pytest.mark.slow  # about a minute on a loaded 2-core machine
def test_the_cpu_recipe_runs_two_steps_scored_by_the_code_reward(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="llama")
    cfg = load_config(EXAMPLES / "code_grpo_cpu.yaml", [
        f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={model}", "actor.dtype=float32",
        "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "local_engine.max_seq_len=256", "gconfig.max_new_tokens=8", "train_dataset.size=16",
        "train_dataset.batch_size=2", "valid_dataset.size=3", "total_train_steps=2",
        "stats_logger.progress_bar=false", "stats_logger.plot=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1"])
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = read_stats(run / "stats.jsonl")
    assert [r["kind"] for r in rows] == ["eval", "train", "train", "eval"]
    items = {item["id"]: item for item in held_out_tasks(size=3, seed=0)}
    for step in (0, 2):
        samples = [json.loads(line) for line in (run / "eval" / f"step{step}.jsonl").open()]
        assert sorted(s["task_id"] for s in samples) == sorted(items)
        for s in samples:  # the logged reward is the code reward of the logged completion
            reward, info = code_reward(s["completion"], items[s["task_id"]])
            assert s["reward"] == reward
            assert s["reward_info"]["tests"] == len(items[s["task_id"]]["tests"])
            assert s["reward_info"]["passed"] == info["passed"]
            assert s["reward_info"]["limits"]["cpu_s"] == DEFAULT_LIMITS.cpu_s
            assert s["reward_info"]["limits"]["network"] is False
            assert "rlimits" in s["reward_info"]["isolation"]
    batches = [json.loads(line) for line in (run / "batches.jsonl").open()]
    assert [len(b["rewards"]) for b in batches] == [8, 8]  # 2 prompts x 4 samples
    assert all(0.0 <= r <= 1.0 for b in batches for r in b["rewards"])


def test_the_gpu_recipe_builds_its_workflow_reward_and_data_loader():
    cfg = load_config(EXAMPLES / "code_grpo.yaml")
    assert resolve_reward_fn(cfg.workflow.reward_fn) is code_reward
    workflow = RLVRWorkflow.from_config(make_tiny_tokenizer(), cfg.gconfig, cfg.workflow)
    try:
        assert workflow.reward.name == "asyncrl.agents.code_reward:code_reward"
        assert workflow.system_prompt.endswith("```python code block.")
    finally:
        workflow.close()
    for dataset in (cfg.train_dataset, cfg.valid_dataset):  # generators resolve (no download)
        module, _, fn = dataset.path.removeprefix("python:").rpartition(":")
        assert callable(getattr(importlib.import_module(module), fn))
    assert (cfg.train_dataset.task_kwargs, cfg.valid_dataset.task_kwargs) == \
        ({"split": "train"}, {"split": "test"})
