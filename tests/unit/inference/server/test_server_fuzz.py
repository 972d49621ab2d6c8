"""The inference server fuzzed from its own OpenAPI description (schemathesis, fuzzing.py).

Every request schemathesis makes from /openapi.json, valid and invalid, must get an answer
below 500 within the timeout. With a key, every route but /health and /openapi.json answers
401 without it. Large bodies get 413, and idle connections do not starve a real request.
"""

from __future__ import annotations

import pytest
import requests
from fuzzing import assert_idle_connections_do_not_starve, fuzz
from serving import serving

from asyncrl.inference.server.app import InferenceServer
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model

KEY = "fuzz-key-0123456789"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")
    from asyncrl.config.schema import LocalEngineConfig

    engine = LocalEngine(model, LocalEngineConfig(max_batch_size=4, max_seq_len=128,
                                                  dtype="float32"))
    engine.start()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine):
    with serving(InferenceServer(engine, model_name="tiny", api_key=KEY).app) as base:
        yield base


def test_no_request_from_the_description_fails_the_server(url):
    calls = fuzz(url, {"Authorization": f"Bearer {KEY}"})
    statuses = {status for _, status in calls}
    assert len(calls) >= 3 * 2 * 20 and 200 in statuses and 400 in statuses


def test_the_description_covers_the_data_plane_and_no_control_route(url):
    paths = set(requests.get(f"{url}/openapi.json", timeout=10).json()["paths"])
    assert paths == {"/health", "/version", "/generate", "/v1/models", "/v1/models/{model}",
                     "/v1/completions", "/v1/chat/completions", "/v1/responses",
                     "/v1/messages", "/v1/messages/count_tokens"}


@pytest.mark.parametrize("method, path", [
    ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/v1/models/policy"),
    ("POST", "/generate"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/pause"),
    ("POST", "/update_weights"), ("GET", "/weights_checksum"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses")])
def test_every_route_but_health_needs_the_key(url, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong-key-0000"}, {"x-api-key": "wrong"}):
        assert requests.request(method, url + path, json={}, headers=headers,
                                timeout=10).status_code == 401
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/openapi.json", timeout=10).status_code == 200


def test_a_body_over_the_size_limit_gets_413(url):
    body = b'{"input_ids": [' + b"1," * (1 << 20) + b"1]}"  # ~2 MiB
    r = requests.post(url + "/generate", data=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"})
    assert r.status_code == 413


def test_max_tokens_past_the_context_stop_at_the_context(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 10**9,
                            "stop": [], "temperature": 1.0})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 128
    r = requests.post(url + "/generate", headers=headers, timeout=60,
                      json={"input_ids": [1, 2], "sampling": {"max_new_tokens": 10**9}})
    assert r.status_code == 200  # /generate stops at the context: 128 tokens here
    assert len(r.json()["output_ids"]) <= 128 - 2


def test_idle_connections_do_not_starve_a_real_request(url):
    assert_idle_connections_do_not_starve(url, "/generate", {
        "input_ids": [1, 2, 3], "sampling": {"max_new_tokens": 4}},
        {"Authorization": f"Bearer {KEY}"})
