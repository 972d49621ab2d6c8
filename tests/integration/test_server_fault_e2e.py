"""An inference server killed mid-run: routed around, restarted, re-synced; nothing lost."""

import json
from collections import Counter
from pathlib import Path

import pytest
from procs import train_killing
from tiny_run import tiny_run_config

from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration


def _train_killing_server(cfg, run: Path, index: int) -> dict:
    """Train `cfg` while server `index` is killed after step 1; check that nothing was lost:
    6 steps, one restart, the staleness bound, no episode or item trained twice."""
    summary = train_killing(cfg, run, "inference", index)
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["inference/server_restarts"] == 1
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(r["rollout/episodes_failed"] == 0 for r in rows)
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    trained = [tid for b in batches for tid in b["task_ids"]]
    groups = Counter(gid for b in batches for gid in b["group_ids"])
    # 6 steps x 2 prompts x 2 samples; no episode twice, no item twice (64 items, one epoch)
    assert len(trained) == 24 and set(groups.values()) == {2} and len(groups) == 12
    assert len(set(trained)) == 12
    return summary


@pytest.mark.parametrize("router", [pytest.param("inline", marks=pytest.mark.slow), "service"])
def test_a_killed_server_is_restarted_and_every_item_is_trained_once(tmp_path, router):
    """With the controller's client routing, or the router service (which then drops,
    re-syncs and re-admits the server)."""
    model = make_tiny_model(tmp_path / "model", arch="llama")
    cfg = tiny_run_config(tmp_path, model, "allocation_mode=local:d2+fsdp:d1",
                          "total_train_steps=6", "scheduler.inference_threads=2",
                          "rollout.health_check_interval=0.5", f"scheduler.router={router}",
                          name="fault")
    run = Path(tmp_path / "runs" / "fault" / cfg.trial_name)
    summary = _train_killing_server(cfg, run, index=1)
    log = (run / "logs" / "trainer.log").read_text()
    assert "inference server 1 failed two health checks; restarting it" in log
    if router == "service":
        log = (run / "logs" / "router-0.log").read_text()
    assert "is back in routing at version" in log  # re-synced to the current weights
    assert summary["run_dir"] == str(run)


@pytest.mark.slow  # ~25 s; the killed-server test above restarts a server in every suite
def test_the_only_server_killed_is_restarted_and_the_run_goes_on(tmp_path):
    """One server (the quickstart's layout): no other server takes its requests, so they
    wait for it; the trainer restarts it while waiting for a batch or when a weight update
    finds it dead, and publishes again."""
    model = make_tiny_model(tmp_path / "model", arch="llama")
    cfg = tiny_run_config(tmp_path, model, "allocation_mode=local:d1+fsdp:d1",
                          "total_train_steps=6", name="fault")
    run = Path(tmp_path / "runs" / "fault" / cfg.trial_name)
    _train_killing_server(cfg, run, index=0)
    log = (run / "logs" / "trainer.log").read_text()
    assert "restarting it" in log and "is back in routing at version" in log


def test_a_server_dead_during_a_background_load_is_restarted_and_loads_again(tmp_path,
                                                                              monkeypatch):
    """actor.weight_update_overlap: the only server dies while it should load v2 in the
    background; the trainer finds the failed load when it next waits for it, restarts the
    server, has it load v2 and goes on."""
    import os
    import signal

    from asyncrl.weights import WeightPublisher

    model = make_tiny_model(tmp_path / "model", arch="llama")
    cfg = tiny_run_config(tmp_path, model, "allocation_mode=local:d1+fsdp:d1",
                          "total_train_steps=4", name="fault")
    run = Path(tmp_path / "runs" / "fault" / cfg.trial_name)
    load, loads = WeightPublisher.load, []

    async def load_once_dead(self, version):
        if version == 2 and 2 not in loads:
            workers = json.loads((run / "services.json").read_text())["workers"]
            pid = next(w["pid"] for w in workers if w["role"] == "inference")
            os.killpg(pid, signal.SIGKILL)
        loads.append(version)
        await load(self, version)

    monkeypatch.setattr(WeightPublisher, "load", load_once_dead)
    from asyncrl.controller.rl import train

    train(cfg)
    log = (run / "logs" / "trainer.log").read_text()
    assert loads == [1, 2, 2, 3, 4], log  # v2 again, on the restarted server
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["inference/server_restarts"] == 1
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    log = (run / "logs" / "trainer.log").read_text()
    assert "weight update v2 failed" in log and "loading again" in log
