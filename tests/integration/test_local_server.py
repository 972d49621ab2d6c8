"""The local inference server over real HTTP, and the client that talks to it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import torch
from aiohttp import web
from procs import read_address
from transformers import AutoModelForCausalLM

from asyncrl.api.types import GenerationRequest, SamplingParams
from asyncrl.inference.client.local import (
    InferenceServerError,
    LocalServerClient,
    WeightUpdateError,
)
from asyncrl.models.tiny import make_tiny_model

torch.set_num_threads(1)
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"v0": make_tiny_model(root / "v0", seed=0), "v1": make_tiny_model(root / "v1", seed=1)}


@pytest.fixture(scope="module")
def server(models):
    """`python -m asyncrl.inference.server.app` on a free loopback port, with an API key."""
    env = {**os.environ, "ASYNCRL_API_KEY": API_KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.inference.server.app", "--model", models["v0"],
         "--port", "0", "--threads", "1", "--dtype", "float32", "--max-batch-size", "4",
         "--max-seq-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield read_address(proc, timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        # SIGTERM shuts the server down cleanly (exit code 0) within seconds.
        assert proc.wait(timeout=15) == 0


@pytest.fixture
def client(server):
    c = LocalServerClient([server], api_key=API_KEY, update_weights_timeout=30)
    yield c
    asyncio.run(c.close())


async def _raw(method: str, url: str, **kw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kw) as r:
        return r.status, await r.json()


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def greedy(ids: list[int], n: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    return GenerationRequest(input_ids=ids, sampling=params)


PROMPT = [70, 71, 72, 73]


@pytest.mark.integration
def test_health_needs_no_key_and_reports_state(server, models):
    status, body = asyncio.run(_raw("GET", server + "/health"))
    assert status == 200
    assert body["status"] == "ok" and body["model"] == models["v0"]
    assert {"version", "running", "waiting", "paused"} <= set(body)


@pytest.mark.integration
def test_every_other_endpoint_needs_the_api_key(server):
    async def go():
        for method, path in [("GET", "/version"), ("POST", "/generate"), ("POST", "/pause")]:
            assert (await _raw(method, server + path))[0] == 401
            wrong = {"Authorization": "Bearer wrong"}
            assert (await _raw(method, server + path, headers=wrong))[0] == 401
        assert (await _raw("GET", server + "/version", headers=AUTH))[0] == 200
    asyncio.run(go())


@pytest.mark.integration
def test_generate_round_trip_equals_hf_greedy(server, client, models):
    async def go():
        version = await client.get_version()
        return version, await client.agenerate(greedy(PROMPT, 12))
    version, resp = asyncio.run(go())
    expected_model = models["v0"] if version == 0 else models["v1"]
    assert resp.output_ids == hf_greedy(expected_model, PROMPT, 12)
    assert resp.output_versions == [version] * 12 and len(resp.output_logprobs) == 12


@pytest.mark.integration
def test_malformed_bodies_get_400_naming_the_field(server):
    async def go():
        url = server + "/generate"
        s1, b1 = await _raw("POST", url, json={"input_ids": "abc"}, headers=AUTH)
        s2, b2 = await _raw("POST", url, headers=AUTH,
                            json={"input_ids": [5], "sampling": {"temperature": -1}})
        s3, b3 = await _raw("POST", url, headers=AUTH,
                            json={"input_ids": [5], "sampling": {"topp": 0.5}})
        s4, b4 = await _raw("POST", url, json={"input_ids": [5] * 300}, headers=AUTH)
        return (s1, b1), (s2, b2), (s3, b3), (s4, b4)
    (s1, b1), (s2, b2), (s3, b3), (s4, b4) = asyncio.run(go())
    assert s1 == 400 and "input_ids" in b1["error"]
    assert s2 == 400 and "temperature" in b2["error"]
    assert s3 == 400 and "sampling.topp" in b3["error"]
    assert s4 == 400 and "max_seq_len" in b4["error"]


@pytest.mark.integration
def test_pause_holds_generation_until_resume(server, client):
    async def go():
        await client.pause()
        assert (await client.health())[0]["paused"] is True
        task = asyncio.ensure_future(client.agenerate(greedy(PROMPT, 4)))
        done, _ = await asyncio.wait([task], timeout=0.5)
        assert not done
        await client.resume()
        resp = await asyncio.wait_for(task, 10)
        assert len(resp.output_ids) == 4
    asyncio.run(go())


@pytest.mark.integration
def test_bad_weight_update_is_400_and_keeps_version(server, client, tmp_path):
    async def go():
        before = await client.get_version()
        status, body = await _raw("POST", server + "/update_weights", headers=AUTH,
                                  json={"path": str(tmp_path / "nope"), "version": 99})
        assert status == 400 and "nope" in body["error"]
        expected = f"{server}.*'update_weights'.*no \\*.safetensors"
        with pytest.raises(WeightUpdateError, match=expected):
            await client.update_weights_from_disk(str(tmp_path), 99)
        health = (await client.health())[0]
        # Resumed after the failure, on the old version.
        assert health["version"] == before and health["paused"] is False
    asyncio.run(go())


@pytest.mark.integration
def test_weight_update_via_client_switches_generation_to_new_weights(server, client, models):
    async def go():
        await client.update_weights_from_disk(models["v1"], 1)
        return await client.get_version(), await client.agenerate(greedy(PROMPT, 10))
    version, resp = asyncio.run(go())
    assert version == 1 and resp.output_versions == [1] * 10
    assert resp.output_ids == hf_greedy(models["v1"], PROMPT, 10)


@pytest.mark.integration
def test_client_works_from_several_event_loops_and_threads(server, client):
    first = asyncio.run(client.agenerate(greedy(PROMPT, 3)))
    result = {}
    def in_thread() -> None:
        result["r"] = asyncio.run(client.agenerate(greedy(PROMPT, 3)))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(30)
    assert result["r"].output_ids == first.output_ids


# ---- client behaviour against fake servers (no model) ------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_fails_fast_when_nobody_listens():
    address = f"127.0.0.1:{_free_port()}"
    client = LocalServerClient([address])  # default: 3 retries, 0.25 s backoff doubling
    start = time.monotonic()
    with pytest.raises(InferenceServerError, match=f"http://{address} cannot be reached"):
        asyncio.run(client.agenerate(greedy(PROMPT, 3)))
    assert time.monotonic() - start < 5
    asyncio.run(client.close())


class FakeServers:
    """Loopback aiohttp servers that record calls; /generate waits `delay` seconds."""

    def __init__(self, n: int, delay: float = 0.2, update_delay: float = 0.0):
        self.calls: list[tuple[int, str, str]] = []  # (server, path, rid)
        self.delay, self.update_delay = delay, update_delay
        self.addresses: list[str] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(n, ready), daemon=True).start()
        ready.wait(10)

    def _run(self, n: int, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        for i in range(n):
            app = web.Application()
            app.add_routes([web.post("/generate", self._handler(i, "generate")),
                            web.post("/pause", self._handler(i, "pause")),
                            web.post("/resume", self._handler(i, "resume")),
                            web.post("/update_weights", self._handler(i, "update_weights"))])
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
            self.addresses.append("http://%s:%d" % runner.addresses[0][:2])
        ready.set()
        self.loop.run_forever()

    def _handler(self, i: int, name: str):
        async def handle(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            self.calls.append((i, name, body.get("rid", "")))
            if name == "generate":
                await asyncio.sleep(self.delay)
                return web.json_response({
                    "rid": body["rid"], "input_ids": body["input_ids"], "output_ids": [1],
                    "output_logprobs": [0.0], "output_versions": [0], "stop_reason": "stop"})
            if name == "update_weights":
                await asyncio.sleep(self.update_delay)
            return web.json_response({})
        return handle


def test_client_routes_to_least_busy_server_and_pins_rids():
    fakes = FakeServers(2)
    client = LocalServerClient(fakes.addresses)

    async def go():
        reqs = [GenerationRequest(input_ids=[5], rid=f"r{i}") for i in range(4)]
        await asyncio.gather(*(client.agenerate(r) for r in reqs))
        first = {rid: srv for srv, _, rid in fakes.calls}
        await asyncio.gather(*(client.agenerate(r) for r in reqs))  # same rids again
        return first
    first = asyncio.run(go())
    assert sorted(first.values()) == [0, 0, 1, 1]  # 4 concurrent requests spread 2 / 2
    assert all(first[rid] == srv for srv, _, rid in fakes.calls)  # each rid kept its server
    asyncio.run(client.close())


def test_requests_of_one_affinity_key_share_a_server_whatever_their_rids():
    fakes = FakeServers(2)
    client = LocalServerClient(fakes.addresses)

    async def go():
        # Two sessions of three turns each, all in flight at once: without affinity the
        # least-busy rule would spread each session's turns over both servers.
        reqs = [GenerationRequest(input_ids=[5], rid=f"{s}-turn{t}", affinity=s)
                for t in range(3) for s in ("sess-a", "sess-b")]
        await asyncio.gather(*(client.agenerate(r) for r in reqs))
    asyncio.run(go())
    by_session = {}
    for srv, _, rid in fakes.calls:
        by_session.setdefault(rid.split("-turn")[0], set()).add(srv)
    assert by_session == {"sess-a": {0}, "sess-b": {1}} or by_session == {"sess-a": {1},
                                                                          "sess-b": {0}}
    asyncio.run(client.close())


def test_weight_update_timeout_raises_naming_server_and_step_then_resumes():
    fakes = FakeServers(1, update_delay=5.0)
    client = LocalServerClient(fakes.addresses, update_weights_timeout=0.5)
    start = time.monotonic()
    expected = f"{fakes.addresses[0]} at step 'update_weights'.*0.5s"
    with pytest.raises(WeightUpdateError, match=expected):
        asyncio.run(client.update_weights_from_disk("/some/path", 3))
    assert time.monotonic() - start < 3
    assert [name for _, name, _ in fakes.calls] == ["pause", "update_weights", "resume"]
    asyncio.run(client.close())
