"""The gateway, the agent proxy and the training service fuzzed from their own OpenAPI
descriptions (api/openapi.py, through fuzzing.py): no answer is a 5xx, whatever the
body, with and without the right key.

The gateway and the proxy answer from a real engine (a tiny random model in this
process). The training service runs a real `RLWorker` on the tiny model; its two routes
that dial an address from the body (/weights/connect, /weights/free_port) are not in its
description and not fuzzed (a fuzzer must not make this process connect anywhere).
"""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch.distributed as dist
from fuzzing import assert_idle_connections_do_not_starve, fuzz, oversized_status
from serving import serving

from asyncrl.agents.proxy import AgentProxy
from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.config import load_config
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.controller.specs import build_trainer_spec
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.openai.routes import openai_app
from asyncrl.trainer.service import TrainingService
from asyncrl.trainer.worker import RLWorker

KEY = "fuzz-key-0123456789"
ADMIN = "fuzz-admin-0123456789"
MODEL = "tiny"
GENERATION = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


class InProcess:
    """An `InferenceEngine`'s generate call over a LocalEngine running in this process."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        return await asyncio.to_thread(self.engine.generate, req, 60)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.fixture(scope="module")
def engine(model):
    engine = LocalEngine(model, LocalEngineConfig(max_batch_size=8, max_seq_len=128,
                                                  dtype="float32"))
    engine.start()
    yield InProcess(engine)
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_the_gateway_answers_every_request_of_its_description_below_500(engine, tokenizer):
    app = openai_app(engine, tokenizer, MODEL, api_key=KEY, max_model_len=128)
    with serving(app) as url:
        calls = fuzz(url, {"Authorization": f"Bearer {KEY}"})
        statuses = {status for _, status in calls}
        assert {200, 400} <= statuses and len(calls) >= 2 * 2 * 20
        assert {p for p, s in calls if s == 200} & GENERATION
        # without the key: 401 everywhere but the description itself
        assert {s for _, s in fuzz(url, {}, examples=3)} == {401}
        assert requests.get(f"{url}/openapi.json", timeout=10).status_code == 200


def test_the_agent_proxy_answers_every_request_of_its_description_below_500(engine, tokenizer):
    proxy = AgentProxy(engine, tokenizer, MODEL, admin_key=ADMIN)
    with serving(proxy.app()) as url:
        start = requests.post(f"{url}/rl/start_session", json={"task_id": "fuzz"}, timeout=10,
                              headers={"Authorization": f"Bearer {ADMIN}"})
        assert start.status_code == 200
        session_key = start.json()["api_key"]
        # the generation routes with a session's key (ending the session is left to the
        # admin pass, so that the session lives through this one)
        as_session = fuzz(url, {"Authorization": f"Bearer {session_key}"},
                          skip={"/rl/end_session"})
        ok = {p for p, s in as_session if s == 200}
        # most drawn bodies are refused (empty prompts, n > 64, ...); some are answered
        assert "/v1/models" in ok and len(ok & GENERATION) >= 2, as_session
        as_admin = fuzz(url, {"Authorization": f"Bearer {ADMIN}"}, examples=15)
        assert {p for p, s in as_admin if s == 200} >= {"/rl/start_session", "/rl/sessions"}
        keyless = {(p, s) for p, s in fuzz(url, {}, examples=3) if p != "/health"}
        assert {s for _, s in keyless} == {401}, keyless
    # every session the fuzzing left was ended cleanly or is still active: none broke
    assert proxy.store.counts.get("error", 0) == 0


def test_the_gateway_and_the_proxy_refuse_large_bodies_and_survive_idle_connections(
        engine, tokenizer):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with serving(openai_app(engine, tokenizer, MODEL, api_key=KEY, max_model_len=128)) as url:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert oversized_status(url, "/v1/completions", headers, mib=2) == 413  # > 1 MiB
        assert_idle_connections_do_not_starve(url, "/v1/chat/completions", chat, headers)
    proxy = AgentProxy(engine, tokenizer, MODEL, admin_key=ADMIN)
    with serving(proxy.app()) as url:
        start = requests.post(f"{url}/rl/start_session", json={"task_id": "big"}, timeout=10,
                              headers={"Authorization": f"Bearer {ADMIN}"})
        headers = {"Authorization": f"Bearer {start.json()['api_key']}"}
        assert oversized_status(url, "/v1/completions", headers, mib=9) == 413  # > 8 MiB
        assert_idle_connections_do_not_starve(url, "/v1/chat/completions", chat, headers)


@pytest.fixture
def worker(model, tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={model}",
                             "actor.dtype=float32", "train_dataset.path=unused.jsonl"])
    worker = RLWorker(build_trainer_spec(cfg))
    yield worker
    worker.destroy()
    assert not dist.is_initialized()  # also after the test's second /initialize


def test_the_training_service_answers_every_request_of_its_description_below_500(
        worker, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    service = TrainingService(worker, api_key=KEY, root=root)
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(service.app) as url:
        def post(route, body):
            return requests.post(url + route, json=body, headers=headers, timeout=60)

        # before /initialize: 409 naming what to call first, not a 500
        r = requests.get(url + "/info", headers=headers, timeout=10)
        assert r.status_code == 409 and "POST /initialize first" in r.json()["error"]
        assert post("/initialize", {"total_steps": 2}).status_code == 200
        calls = fuzz(url, headers, examples=10)
        statuses = {status for _, status in calls}
        assert {200, 400} <= statuses
        # paths: under cluster.fileroot only; a missing one is 404
        assert post("/initialize", {"total_steps": 2}).status_code == 200
        assert post("/save_hf", {"path": str(root / "run" / "hf")}).status_code == 200
        assert (root / "run" / "hf" / "config.json").is_file()
        escape = post("/save_state", {"path": str(root / ".." / "outside")})
        assert escape.status_code == 400 and "outside the runs' folder" in escape.json()["error"]
        assert not (tmp_path / "outside").exists()
        assert post("/load_state", {"path": str(root / "nothing")}).status_code == 404
        assert post("/weights/broadcast", {}).status_code == 409
        assert {s for p, s in fuzz(url, {}, examples=3) if p != "/health"} == {401}
    assert not list(tmp_path.glob("[!r]*")), "the fuzzing wrote outside the runs' folder"
