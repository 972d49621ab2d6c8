"""The trainer killed with SIGKILL at each fault point, then resumed with recover.mode=auto.

Each run is `asyncrl train` in a subprocess that kills itself at a fault point of step 3
(`api/faults.py`), with a recover checkpoint after every step. The resumed run must restart
from the last whole checkpoint (step 2), train steps 3 and 4 once each, train no item twice,
keep the staleness bound, and leave no inference server behind.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import server_pids
from tiny_run import tiny_run_overrides

from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ETA = 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def run_train(overrides: list[str], fault: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("ASYNCRL_FAULT", None)
    if fault:
        env["ASYNCRL_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", *overrides], env=env,
                          check=False, capture_output=True, text=True, timeout=300)


def wait_gone(model: str, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := server_pids(model)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# `generate` in CI; the others are the same test at other points (slow).
POINTS = ["checkpoint", pytest.param("generate", marks=pytest.mark.slow),
          pytest.param("train", marks=pytest.mark.slow),
          pytest.param("publish", marks=pytest.mark.slow)]


@pytest.mark.parametrize("point", POINTS)
def test_a_trainer_killed_at_step_3_resumes_from_step_2_and_loses_nothing(tmp_path, tiny_model,
                                                                          point):
    overrides = tiny_run_overrides(
        tmp_path, tiny_model, "total_train_steps=4", f"rollout.max_head_offpolicyness={ETA}",
        "recover.mode=auto", "recover.freq_steps=1", name="kill")
    run = tmp_path / "runs" / "kill" / "trial0"

    killed = run_train(overrides, fault=f"{point}@3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not wait_gone(tiny_model), "an inference server outlived its killed trainer"
    before = [r["step"] for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"] \
        if (run / "stats.jsonl").exists() else []
    # Only `checkpoint` logged step 3 before dying; its checkpoint is the torn one.
    assert before == ([1, 2, 3] if point == "checkpoint" else [1, 2])

    resumed = run_train(overrides, fault=None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stderr and "resumed from" in resumed.stderr
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= ETA for r in rows)
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == [1, 2, 3, 4]
    trained = [task for b in batches for task in set(b["task_ids"])]
    assert len(trained) == len(set(trained)) == 4 * 2  # 2 prompts a step, none twice
    assert not wait_gone(tiny_model)
