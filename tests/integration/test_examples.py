"""The shipped entry points run: the GSM8K example script and the `asyncrl` console script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.models.tiny import make_tiny_model

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_gsm8k_example_runs_one_step_on_local_gsm8k_files(tmp_path, gsm8k_dir):
    model = make_tiny_model(tmp_path / "model")
    cmd = [
        sys.executable, str(REPO / "examples/math/gsm8k_rl.py"),
        "--config", str(REPO / "examples/math/gsm8k_grpo_cpu.yaml"), "scheduler.type=local",
        f"actor.path={model}", f"train_dataset.path={gsm8k_dir}", f"valid_dataset.path={gsm8k_dir}",
        "train_dataset.size=16", "valid_dataset.size=2", "total_train_steps=1",
        "gconfig.max_new_tokens=8", "local_engine.max_seq_len=1024", "actor.dtype=float32",
        "local_engine.dtype=float32", "train_dataset.max_length=900",
        f"cluster.fileroot={tmp_path / 'runs'}", "stats_logger.progress_bar=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "gsm8k-grpo-cpu" / "trial0"
    rows = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]
    # the evaluation before training runs beside step 1, so its row may come after step 1's
    assert sorted((r["step"], r["kind"]) for r in rows) == [(0, "eval"), (1, "eval"), (1, "train")]
    train_row = next(r for r in rows if r["kind"] == "train")
    assert train_row["rollout/output_tokens_mean"] <= 8
    assert "held-out reward before training" in out.stdout


def test_console_script_reports_a_typo_with_the_nearest_key(tmp_path):
    exe = Path(sys.executable).with_name("asyncrl")
    out = subprocess.run(
        [str(exe), "train", "--config", str(REPO / "examples/math/gsm8k_grpo_cpu.yaml"),
         "rollout.max_head_offpolicynes=1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "did you mean 'rollout.max_head_offpolicyness'?" in out.stderr
