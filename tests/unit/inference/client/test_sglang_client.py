"""The SGLang client against a loopback server replaying a recorded exchange.

The exchange (tests/fixtures/sglang/exchange.json) says where its shapes come from. The
fake server answers each request with the next recorded answer for its path, after
checking that the request body is the recorded one.
"""

import asyncio
import base64
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.inference.client.base import InferenceServerError, WeightUpdateError
from asyncrl.inference.client.sglang import SGLangClient, moe_route_shape

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
    client = SGLangClient([server.address], update_weights_timeout=5)
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
    client = SGLangClient([server.address], update_weights_timeout=5)
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
    client = SGLangClient([server.address], update_weights_timeout=5)

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


# LoRA: SGLang's adapter routes, in the shapes of its http_server.py and io_struct.py
# (LoadLoRAAdapterReqInput: lora_name, lora_path; the answer LoRAUpdateOutput: success,
# error_message, loaded_adapters, status 400 when success is false; UnloadLoRAAdapterReqInput:
# lora_name; UpdateWeightVersionReqInput: new_version; GenerateReqInput.lora_path naming a
# loaded adapter). Token ids, log-probs and messages are made up.
def post(path: str, body: dict, answer: dict, status: int = 200) -> dict:
    return {"request": {"method": "POST", "path": path, "body": body},
            "response": {"status": status, "body": answer}}


OK = {"message": "ok", "status": "ok"}


def generate_entry(adapter: str | None, token: int, logprob: float) -> dict:
    body = {"input_ids": [1, 60], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                "top_k": -1, "stop_token_ids": [], "stop": [],
                                "ignore_eos": False, "skip_special_tokens": False},
            **({"lora_path": adapter} if adapter else {})}
    return post("/generate", body, {"output_ids": [token], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[logprob, token, None]]}})


def adapter_update(name: str, path: str, version: int, loaded: dict) -> list[dict]:
    return [post("/pause_generation", {"mode": "abort"}, OK),
            post("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                 {"success": True, "error_message": "", "loaded_adapters": loaded}),
            post("/update_weight_version", {"new_version": str(version)},
                 {"success": True, "message": f"Weight version updated to {version}",
                  "new_version": str(version)}),
            post("/continue_generation", {}, OK)]


@pytest.fixture
def adapter_folders(tmp_path):
    """Four LoRA adapter folders (PEFT's two files), by version."""
    folders = {}
    for v in (1, 2, 3, 4):
        folder = tmp_path / f"a{v}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (folder / "adapter_model.safetensors").write_bytes(b"")
        folders[v] = str(folder)
    return folders


def test_lora_versions_load_as_new_adapters_that_generation_names(adapter_folders):
    a = adapter_folders
    n1, n2, n3 = "asyncrl-lora-v1-1", "asyncrl-lora-v2-2", "asyncrl-lora-v3-3"
    entries = [
        generate_entry(None, 70, -0.5),  # the base, before any publish
        *adapter_update(n1, a[1], 1, {n1: a[1]}),
        generate_entry(n1, 71, -0.25),
        *adapter_update(n2, a[2], 2, {n1: a[1], n2: a[2]}),
        *adapter_update(n3, a[3], 3, {n1: a[1], n2: a[2], n3: a[3]}),
        post("/unload_lora_adapter", {"lora_name": n1},
             {"success": True, "error_message": "", "loaded_adapters": {n2: a[2], n3: a[3]}}),
        # a version the server cannot take: it keeps serving version 3's adapter
        post("/pause_generation", {"mode": "abort"}, OK),
        post("/load_lora_adapter", {"lora_name": "asyncrl-lora-v4-4", "lora_path": a[4]},
             {"success": False, "error_message": "LoRA rank 64 exceeds max_lora_rank 8",
              "loaded_adapters": {n2: a[2], n3: a[3]}}, status=400),
        post("/continue_generation", {}, OK),
        generate_entry(n3, 72, -2.0),
    ]
    server = ReplayServer(entries, {})
    client = SGLangClient([server.address], update_weights_timeout=5)
    req = GenerationRequest(input_ids=[1, 60], sampling=SamplingParams(max_new_tokens=1))

    async def go():
        out = [await client.agenerate(req)]
        await client.update_weights_from_disk(a[1], 1)
        out.append(await client.agenerate(req))
        await client.update_weights_from_disk(a[2], 2)
        await client.update_weights_from_disk(a[3], 3)
        with pytest.raises(WeightUpdateError, match="version 4 failed on .* at step "
                           "'load_lora_adapter'.*LoRA rank 64 exceeds max_lora_rank 8"):
            await client.update_weights_from_disk(a[4], 4)
        out.append(await client.agenerate(req))
        await client.close()
        return out

    out = asyncio.run(go())
    assert server.errors == [] and all(server.used)
    assert [p for p, _ in server.seen] == [e["request"]["path"] for e in entries]
    assert [(r.output_ids, r.output_logprobs, r.output_versions) for r in out] == [
        ([70], [-0.5], [0]), ([71], [-0.25], [1]), ([72], [-2.0], [3])]


def test_an_adapter_folder_without_its_weights_is_refused_before_any_pause(adapter_folders):
    import os

    os.remove(os.path.join(adapter_folders[1], "adapter_model.safetensors"))
    server = ReplayServer([], {})
    client = SGLangClient([server.address], update_weights_timeout=5)
    with pytest.raises(WeightUpdateError, match="has no adapter_model.safetensors"):
        asyncio.run(client.update_weights_from_disk(adapter_folders[1], 1))
    asyncio.run(client.close())
    assert server.seen == []


# Routed experts: GenerateReqInput.return_routed_experts, answered in meta_info.routed_experts
# as the base64 of an int32 [input + output tokens - 1, layers, top_k] array (SGLang PR
# #12162, tokenizer_manager.py; the shape from SGLang's docs). Expert ids are made up.
LAYERS, TOP_K = 2, 2


def routes_b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")


def made_up_routes(n_tokens: int, offset: int) -> np.ndarray:
    """Distinct ids per token, layer and pick, shifted by `offset` (another weight version)."""
    return (np.arange(n_tokens * LAYERS * TOP_K) + offset).reshape(n_tokens, LAYERS, TOP_K) % 8


def routed_generate(input_ids, outputs, finish, routes=None, max_new_tokens=5):
    body = {"input_ids": input_ids, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                "top_p": 1.0, "top_k": -1, "stop_token_ids": [], "stop": [],
                                "ignore_eos": False, "skip_special_tokens": False}}
    meta = {"finish_reason": {"type": finish},
            "output_token_logprobs": [[-0.5, t, None] for t in outputs]}
    if routes is not None:
        meta["routed_experts"] = routes_b64(routes)
    return post("/generate", body, {"output_ids": outputs, "meta_info": meta})


def test_routed_experts_of_the_last_piece_cover_every_token_and_the_last_is_minus_one(
        exchange):
    _, subs = exchange
    # piece 1: 3 tokens, then aborted by the update (without routes); piece 2 runs the
    # prompt and those 3 again under version 1 and samples 2 more: 7 + 2 - 1 = 8 rows
    second = made_up_routes(8, offset=3)
    entries = [
        {**routed_generate([1, 60, 61, 62], [77, 78, 79], "abort"),
         "hold_until": "/pause_generation"},
        post("/pause_generation", {"mode": "abort"}, OK),
        post("/update_weights_from_disk", {"model_path": subs["<WEIGHTS_1>"],
                                           "weight_version": "1"},
             {"success": True, "message": "ok", "num_paused_requests": 0}),
        post("/continue_generation", {}, OK),
        routed_generate([1, 60, 61, 62, 77, 78, 79], [80, 2], "stop", second,
                        max_new_tokens=2),
    ]
    server = ReplayServer(entries, subs)
    client = SGLangClient([server.address], update_weights_timeout=5,
                          moe_routes=(LAYERS, TOP_K))
    req = GenerationRequest(input_ids=[1, 60, 61, 62], rid="r",
                            sampling=SamplingParams(max_new_tokens=5, temperature=1.0))

    async def go():
        gen = asyncio.ensure_future(client.agenerate(req))
        while not any(p == "/generate" for p, _ in server.seen):
            await asyncio.sleep(0.01)
        await client.update_weights_from_disk(subs["<WEIGHTS_1>"], 1)
        return await gen

    resp = asyncio.run(go())
    asyncio.run(client.close())
    assert server.errors == [] and all(server.used)
    assert resp.output_ids == [77, 78, 79, 80, 2] and resp.output_versions == [0, 0, 0, 1, 1]
    routes = resp.routed_experts
    assert routes.dtype == torch.int16 and list(routes.shape) == [9, LAYERS, TOP_K]
    assert routes[:8].tolist() == second.tolist()
    assert (routes[8] == -1).all()


def test_an_answer_without_routed_experts_names_the_server_flag():
    server = ReplayServer([routed_generate([1, 60], [70], "length", max_new_tokens=1)], {})
    client = SGLangClient([server.address], moe_routes=(LAYERS, TOP_K))
    req = GenerationRequest(input_ids=[1, 60], sampling=SamplingParams(max_new_tokens=1))
    with pytest.raises(InferenceServerError, match="--enable-return-routed-experts"):
        asyncio.run(client.agenerate(req))
    asyncio.run(client.close())


def test_routed_experts_of_another_model_s_size_are_refused():
    # the prompt's 2 tokens and the output's 1, the last excepted: 2 rows of 2 layers x 2
    # picks = 8 ids; 6 ids (one row of 3 layers) are another model's
    wrong = made_up_routes(2, 0).reshape(-1)[:6].reshape(1, 3, 2)
    server = ReplayServer([routed_generate([1, 60], [70], "length", wrong,
                                           max_new_tokens=1)], {})
    client = SGLangClient([server.address], moe_routes=(LAYERS, TOP_K))
    req = GenerationRequest(input_ids=[1, 60], sampling=SamplingParams(max_new_tokens=1))
    with pytest.raises(InferenceServerError, match="6 expert ids, not 2 tokens x 2 MoE"):
        asyncio.run(client.agenerate(req))
    asyncio.run(client.close())


def test_moe_route_shape_reads_the_config_and_refuses_dense_layers():
    import transformers

    config = transformers.Qwen3MoeConfig(num_hidden_layers=3, num_experts=8,
                                         num_experts_per_tok=2).to_dict()
    assert moe_route_shape(config) == (3, 2)
    with pytest.raises(ValueError, match=r"dense layers \[0, 2\]"):
        moe_route_shape(config | {"decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="no experts"):
        moe_route_shape(transformers.Qwen3Config(num_hidden_layers=2).to_dict())
