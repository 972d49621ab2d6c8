"""The SGLang client against a loopback server replaying a recorded exchange.

The exchange (tests/fixtures/sglang/exchange.json) says where its shapes come from. The
fake server answers each request with the next recorded answer for its path, after
checking that the request body is the recorded one.
"""

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.inference.client.base import InferenceServerError, WeightUpdateError
from asyncrl.inference.client.sglang import SGLangInferenceEngine

EXCHANGE = Path(__file__).resolve().parents[3] / "fixtures" / "sglang" / "exchange.json"


class ReplayServer:
    """Answers requests from a recorded exchange; records mismatches instead of guessing.

    Paths in `absent` answer 404 as a server without that route does (FastAPI's answer)."""

    def __init__(self, entries: list[dict], substitutions: dict[str, str],
                 absent: frozenset[str] = frozenset()):
        text = json.dumps(entries)
        for key, value in substitutions.items():
            text = text.replace(key, value)
        self.entries = json.loads(text)
        self.used = [False] * len(self.entries)
        self.seen: list[tuple[str, dict]] = []  # (path, body) in arrival order
        self.errors: list[str] = []
        self.absent = absent
        self.loop = asyncio.new_event_loop()
        self._arrived: dict[str, asyncio.Event] = {}
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        self.address = "http://%s:%d" % runner.addresses[0][:2]
        ready.set()
        self.loop.run_forever()

    def _event(self, path: str) -> asyncio.Event:
        return self._arrived.setdefault(path, asyncio.Event())

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else None
        self.seen.append((path, body))
        self._event(path).set()
        if path in self.absent:
            return web.json_response({"detail": "Not Found"}, status=404)
        for i, entry in enumerate(self.entries):
            rec = entry["request"]
            if self.used[i] or rec["method"] != request.method or rec["path"] != path:
                continue
            self.used[i] = True
            got = {k: v for k, v in (body or {}).items() if k != "rid"}  # rids are per run
            if "body" in rec and got != rec["body"]:
                self.errors.append(f"{path}: body {got} != recorded {rec['body']}")
            if "hold_until" in entry:
                await self._event(entry["hold_until"]).wait()
            return web.json_response(entry["response"]["body"], status=entry["response"]["status"])
        self.errors.append(f"unexpected {request.method} {path} {body}")
        return web.json_response({"error": "not in the recording"}, status=500)


@pytest.fixture
def exchange(tmp_path):
    """The recorded exchanges, with two checkpoint folders for their placeholders."""
    subs = {}
    for v in (1, 2):
        folder = tmp_path / f"v{v}"
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
        subs[f"<WEIGHTS_{v}>"] = str(folder)
    return json.loads(EXCHANGE.read_text()), subs


def test_generation_aborted_by_a_weight_update_is_resubmitted_and_stitched(exchange):
    recorded, subs = exchange
    server = ReplayServer(recorded["generate_across_update"], subs)
    client = SGLangInferenceEngine([server.address], update_weights_timeout=5)
    req = GenerationRequest(input_ids=[1, 60, 61, 62], rid="r1",
                            sampling=SamplingParams(max_new_tokens=8, temperature=1.0))

    async def go():
        assert await client.get_version() == 0  # "default": the weights it started with
        gen = asyncio.ensure_future(client.agenerate(req))
        while not any(p == "/generate" for p, _ in server.seen):
            await asyncio.sleep(0.01)
        await client.update_weights_from_disk(subs["<WEIGHTS_1>"], 1)
        resp = await gen
        return resp, await client.get_version()

    resp, version = asyncio.run(go())
    asyncio.run(client.close())
    assert server.errors == [] and all(server.used)
    assert resp.output_ids == [77, 78, 79, 80, 81, 2]
    assert resp.output_logprobs == [-1.5, -0.25, -2.0, -0.5, -0.75, -0.125]
    assert resp.output_versions == [0, 0, 0, 1, 1, 1]
    assert resp.stop_reason.value == "stop" and version == 1
    rids = [body["rid"] for path, body in server.seen if path == "/generate"]
    assert rids == ["r1-0", "r1-3"]  # one rid per piece, named after the request


def test_failed_weight_update_raises_naming_server_step_and_message_then_resumes(exchange):
    recorded, subs = exchange
    server = ReplayServer(recorded["failed_update"], subs)
    client = SGLangInferenceEngine([server.address], update_weights_timeout=5)
    expected = (f"version 2 failed on {server.address} at step 'update_weights_from_disk'"
                ".*header too large")
    with pytest.raises(WeightUpdateError, match=expected):
        asyncio.run(client.update_weights_from_disk(subs["<WEIGHTS_2>"], 2))
    asyncio.run(client.close())
    assert server.errors == [] and all(server.used)  # continue_generation came last
    assert [p for p, _ in server.seen] == ["/pause_generation", "/update_weights_from_disk",
                                           "/continue_generation"]


def model_info(version: str) -> dict:
    """A /model_info answer in SGLang's shape (model_path and the weight version label)."""
    return {"model_path": "/models/tiny", "tokenizer_path": "/models/tiny",
            "is_generation": True, "preferred_sampling_params": None, "weight_version": version}


def info_entries(route: str, versions: list[str]) -> list[dict]:
    return [{"request": {"method": "GET", "path": route},
             "response": {"status": 200, "body": model_info(v)}} for v in versions]


def read_versions(server: ReplayServer, n: int) -> list[int]:
    client = SGLangInferenceEngine([server.address], update_weights_timeout=5)

    async def go():
        try:
            return [await client.get_version() for _ in range(n)]
        finally:
            await client.close()

    return asyncio.run(go())


def test_version_is_read_from_model_info_on_a_server_without_the_old_route():
    server = ReplayServer(info_entries("/model_info", ["default", "4"]), {},
                          absent=frozenset({"/get_model_info"}))
    assert read_versions(server, 2) == [0, 4]  # "default": the weights it started with
    assert server.errors == [] and all(server.used)
    assert [p for p, _ in server.seen] == ["/model_info", "/model_info"]


def test_a_server_older_than_model_info_is_asked_its_old_route_after_one_404():
    # SGLang <= 0.5.5 has only /get_model_info: one 404 from /model_info, then the old route
    # for this and every later read (three reads: 1 + 3 requests, not 2 x 3).
    server = ReplayServer(info_entries("/get_model_info", ["default", "2", "3"]), {},
                          absent=frozenset({"/model_info"}))
    assert read_versions(server, 3) == [0, 2, 3]
    assert server.errors == [] and all(server.used)
    assert [p for p, _ in server.seen] == ["/model_info", "/get_model_info", "/get_model_info",
                                           "/get_model_info"]


def test_an_error_other_than_404_from_model_info_is_raised_not_retried_on_the_old_route():
    entries = [{"request": {"method": "GET", "path": "/model_info"},
                "response": {"status": 503, "body": {"error": "tokenizer manager not ready"}}}]
    server = ReplayServer(entries, {})
    with pytest.raises(InferenceServerError, match="model_info answered 503"):
        read_versions(server, 1)
    assert [p for p, _ in server.seen] == ["/model_info"]
