"""Process hygiene: `asyncrl serve` alone, and no server outlives its trainer."""

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from procs import server_pids

from asyncrl.launch.local import free_port
from asyncrl.models.tiny import make_tiny_model

pytestmark = pytest.mark.integration
ASYNCRL = str(Path(sys.executable).with_name("asyncrl"))


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("proc") / "model")


def test_serve_binds_loopback_and_answers_health(tiny):
    port = free_port()
    proc = subprocess.Popen([ASYNCRL, "serve", "--model", tiny, "--port", str(port),
                             "--dtype", "float32", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def healthy():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    return json.load(r)["status"] == "ok"
            except OSError:
                return False

        _wait_for(healthy, 60, "the server's /health")
        listening = Path(f"/proc/{proc.pid}/net/tcp").read_text().splitlines()[1:]
        local = {line.split()[1] for line in listening if line.split()[3] == "0A"}  # LISTEN
        assert f"0100007F:{port:04X}" in local  # 127.0.0.1:<port>, not 0.0.0.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)])
def test_no_server_outlives_its_trainer(tmp_path, tiny, sig):
    run = tmp_path / "runs" / "orphans" / "t"
    proc = subprocess.Popen(
        [ASYNCRL, "train", "experiment_name=orphans", "trial_name=t",
         f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={tiny}",
         "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=64",
         "workflow.reward_fn=reasoning_gym", "actor.dtype=float32",
         "local_engine.dtype=float32", "local_engine.max_seq_len=256",
         "gconfig.max_new_tokens=8", "total_train_steps=1000", "stats_logger.progress_bar=false",
         "scheduler.inference_threads=1", "scheduler.trainer_threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (run / "stats.jsonl").exists() and (run / "stats.jsonl").stat().st_size,
                  120, "the first training step")
        assert server_pids(tiny), "the run's server is not running"
        proc.send_signal(sig)
        proc.wait(60)
        _wait_for(lambda: not server_pids(tiny), 30, "the server to exit with its trainer")
    finally:
        if proc.poll() is None:
            proc.kill()
