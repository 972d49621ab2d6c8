"""A server that died and came back is re-synced to the current weights before it serves."""

import asyncio
import json
import time
import urllib.request

import pytest

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client import LocalServerClient
from asyncrl.launch import LocalScheduler
from asyncrl.models.tiny import make_tiny_model

pytestmark = pytest.mark.integration


def _version(address: str) -> int:
    with urllib.request.urlopen(address + "/version", timeout=5) as r:
        return json.load(r)["version"]


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_returning_server_is_resynced_before_it_serves(tmp_path):
    base = make_tiny_model(tmp_path / "v0", seed=0)
    new = make_tiny_model(tmp_path / "v1", seed=1)
    engine_cfg = LocalEngineConfig(dtype="float32", max_batch_size=4, max_seq_len=256)
    sched = SchedulerConfig(inference_threads=2, trainer_threads=1)
    with LocalScheduler(sched, tmp_path / "logs") as scheduler:
        addresses = scheduler.launch_inference_servers(base, engine_cfg, n_servers=2, seed=0)
        client = LocalServerClient(addresses, request_retries=0, update_weights_timeout=30,
                                       health_check_interval=0.3)

        def generate(rid: str):
            req = GenerationRequest(input_ids=[1, 60, 61], rid=rid,
                                    sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
            return asyncio.run(client.agenerate(req))

        try:
            generate("warm-up")  # starts the periodic checks
            scheduler.stop_server(1)
            _wait_for(lambda: client.live_servers == [addresses[0]], 10, "server 1 leaves")
            asyncio.run(client.update_weights_from_disk(new, 1))  # only server 0 is live
            assert _version(addresses[0]) == 1
            responses = [generate(f"while-down-{i}") for i in range(4)]
            assert all(r.output_versions == [1, 1, 1] for r in responses)

            scheduler.restart_server(1)  # same port, base weights again
            _wait_for(lambda: client.live_servers == addresses, 30, "server 1 is back")
            assert _version(addresses[1]) == 1  # loaded before it took any request
            # a fresh rid goes to the least-busy server; both now answer with version 1
            by_server = {client._pinned[r.rid]: r for r in (generate(f"after-{i}") for i in range(4))}
            assert set(by_server) == {0, 1}
            assert all(r.output_versions == [1, 1, 1] for r in by_server.values())
        finally:
            asyncio.run(client.close())
