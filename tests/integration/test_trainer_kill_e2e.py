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


# A synchronous run (eta = 0) with seeded sampling (the default) is a function of its seed:
# each step's batch is the next B items, each sample's tokens come from its own random
# stream, and the trainer is deterministic on CPU. So a run killed mid-step and resumed
# must repeat the uninterrupted run step for step. Tokens and rewards are compared exactly;
# log-probs and losses differ only by the float32 rounding of the server's batching
# (which requests share a forward), measured below RESUME_TOL.
RESUME_TOL = 1e-4


def train_rows(run: Path) -> list[dict]:
    return [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("point", ["train", pytest.param("generate", marks=pytest.mark.slow)])
def test_a_resumed_synchronous_run_repeats_the_uninterrupted_one(tmp_path, tiny_model, point):
    common = ["total_train_steps=4", "rollout.max_head_offpolicyness=0", "recover.mode=auto",
              "recover.freq_steps=1", "gconfig.n_samples=3"]
    straight = run_train(tiny_run_overrides(tmp_path / "a", tiny_model, *common, name="s"), None)
    assert straight.returncode == 0, straight.stderr[-3000:]
    overrides = tiny_run_overrides(tmp_path / "b", tiny_model, *common, name="k")
    assert run_train(overrides, fault=f"{point}@3").returncode == -9
    resumed = run_train(overrides, fault=None)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]

    runs = [tmp_path / x / "runs" / name / "trial0" for x, name in (("a", "s"), ("b", "k"))]
    a, b = (train_rows(run) for run in runs)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    batches = [[json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
               for run in runs]
    for x, y in zip(*batches):
        assert x["task_ids"] == y["task_ids"]
        assert x["rewards"] == y["rewards"]
    for x, y in zip(a, b):
        assert x["rollout/reward"] == y["rollout/reward"]
        assert x["rollout/output_tokens"] == y["rollout/output_tokens"]
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert abs(x[key] - y[key]) <= RESUME_TOL * max(1.0, abs(x[key])), (key, x, y)
