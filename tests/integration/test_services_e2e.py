"""RL with the trainer as a service: two data-parallel ranks (gloo) behind HTTP, resumed."""

import json
from pathlib import Path

import pytest
from procs import server_pids
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def _config(tmp_path, model, steps):
    return tiny_run_config(tmp_path, model, "allocation_mode=local:d1+fsdp:d2",
                           f"total_train_steps={steps}", "recover.mode=auto",
                           "recover.freq_steps=1", "saver.freq_steps=2", name="dp2")


@pytest.mark.slow  # ~60 s; test_offline_ranks and test_all_services_as_processes cover its parts
def test_two_trainer_ranks_train_publish_save_and_resume(tmp_path, tiny_model):
    train(_config(tmp_path, tiny_model, steps=2))
    summary = train(_config(tmp_path, tiny_model, steps=3))  # resumes at step 3
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["rollout/staleness_max"] <= 1
        assert r["train/n_seqs"] == 4  # 2 prompts x 2 samples, whatever the split over ranks
    for rank in (0, 1):
        log = (run / "logs" / f"trainer-{rank}.log").read_text()
        assert f"training service rank {rank} listening on http://127.0.0.1:" in log
    # Rank 0 wrote the published weights and the saved model; both ranks the resume state.
    assert (run / "weights" / "v3" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step2" / "config.json").is_file()
    assert (run / "recover" / "actor" / ".metadata").is_file()
    registry = json.loads((run / "services.json").read_text())
    assert registry["scheduler"] == "local" and registry["workers"] == []  # all stopped
    assert not server_pids(tiny_model), "an inference server outlived its run"
    assert not _trainer_pids(run), "a trainer rank outlived its run"


def _trainer_pids(run: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"asyncrl.trainer.service" in cmd and str(run).encode() in cmd:
            pids.append(int(proc.name))
    return pids


def test_weights_reach_the_servers_by_broadcast_in_the_rl_loop(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "actor.weight_update_mode=broadcast",
                          "actor.weight_update_bucket_mb=1", name="bcast")
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    # Versions 1 and 2 went out by broadcast: nothing was written to disk.
    assert not (run / "weights").exists() or not any((run / "weights").iterdir())
    assert all(r["perf/weights_broadcast_s"] > 0 for r in rows)
    assert rows[-1]["rollout/staleness_max"] <= 1


@pytest.mark.slow  # ~30 s; tests/unit/weights/test_weight_broadcast.py gathers two ranks too
def test_two_trainer_ranks_broadcast_their_weights(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "allocation_mode=local:d1+fsdp:d2",
                          "actor.weight_update_mode=broadcast", name="dp2bcast")
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["perf/weights_broadcast_s"] > 0 and r["train/grad_norm"] > 0 for r in rows)
    assert "perf/weights_connect_s" in rows[0]  # the group formed once, at the first publish
    assert "perf/weights_connect_s" not in rows[1]
    assert not (run / "weights").exists() or not any((run / "weights").iterdir())


@pytest.mark.slow  # test_all_services_as_processes goes through the router by both modes
@pytest.mark.parametrize("mode", ["disk", "broadcast"])
def test_a_router_service_routes_generation_and_weight_updates(tmp_path, tiny_model, mode):
    """scheduler.router=service: the controller reaches two servers only through the router
    process, which carries generation, pauses and both kinds of weight update."""
    cfg = tiny_run_config(tmp_path, tiny_model, "allocation_mode=local:d2+fsdp:d1",
                          "scheduler.inference_threads=2", "scheduler.router=service",
                          f"actor.weight_update_mode={mode}", name=f"router-{mode}")
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/grad_norm"] > 0 and r["rollout/staleness_max"] <= 1 for r in rows)
    roles = [(s["role"], s["index"]) for s in summary["services"]]
    assert roles == [("inference", 0), ("inference", 1), ("router", 0)]
    # Every update went through the router to both servers.
    log = (run / "logs" / "router-0.log").read_text()
    assert "asyncrl router listening on http://127.0.0.1:" in log
    how = "from " if mode == "disk" else "by broadcast"
    for v in (1, 2):
        assert f"weights version {v} {how}" in log and \
            log.split(f"weights version {v} ")[1].split("\n")[0].count("on 2 server(s)") == 1


@pytest.mark.parametrize("mode", ["disk", pytest.param("broadcast", marks=pytest.mark.slow)])
def test_all_services_as_processes(tmp_path, tiny_model, mode):
    """Every role its own process: two servers behind the router, two trainer ranks, and the
    weight-update service carrying each version between them; the controller only talks."""
    cfg = tiny_run_config(tmp_path, tiny_model, "allocation_mode=local:d2+fsdp:d2",
                          "scheduler.inference_threads=2", "scheduler.trainer_threads=2",
                          "scheduler.router=service", "scheduler.weight_update=service",
                          f"actor.weight_update_mode={mode}", "total_train_steps=3",
                          name=f"services-{mode}")
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 and r["rollout/staleness_max"] <= 1 for r in rows)
    assert sorted({s["role"] for s in summary["services"]}) == [
        "inference", "router", "trainer", "weight_update"]
    log = (run / "logs" / "weight_update-0.log").read_text()
    router = (run / "logs" / "router-0.log").read_text()
    for v in (1, 2, 3):
        assert f"version {v} published" in log
        assert f"weights version {v} " in router
    key = "perf/weights_broadcast_s" if mode == "broadcast" else "perf/weights_save_s"
    assert all(r[key] > 0 for r in rows)  # the service's timings reach the controller's stats
    if mode == "disk":
        assert (run / "weights" / "v3" / "model.safetensors").is_file()


def test_weight_update_service_needs_trainer_ranks_as_a_service(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "scheduler.weight_update=service", name="wu")
    with pytest.raises(ValueError, match="scheduler.weight_update=service needs the trainer"):
        train(cfg)
