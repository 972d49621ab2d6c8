"""Requests recorded from runtimes written elsewhere are answered as the real API would.

Each fixture under tests/fixtures/<runtime>/ holds what the runtime sent (sanitised). The
/v1 routes of OpenAI's API are answered 200; the runtime's probes for other servers' APIs
(Ollama's /api/tags, llama.cpp's /props, LM Studio's /api/v1/models), which the real API
does not have either, are 404, which the runtime reads as "not that server".
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from serving import serving as serve_app
from test_chat_shapes import ScriptedEngine

from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai.routes import openai_app

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HERMES = FIXTURES / "hermes" / "calculate.json"
OTHER_SERVERS = {"/api/v1/models", "/api/tags", "/api/show", "/v1/props", "/props", "/version"}


def _requests(path: Path) -> list[tuple[str, dict]]:
    runs = json.loads(path.read_text())["runs"]
    return [(f"{run}-{i}", r) for run, reqs in runs.items() for i, r in enumerate(reqs)]


@pytest.mark.parametrize("name,req", _requests(HERMES), ids=[n for n, _ in _requests(HERMES)])
def test_hermes_agents_recorded_requests_are_answered(name, req):
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "23 + 45 = 68. <answer>68</answer>")
    with serve_app(openai_app(engine, tok, "policy", max_model_len=1_000_000)) as url:
        r = httpx.request(req["method"], f"{url}{req['path']}", headers=req["headers"],
                          content=json.dumps(req["body"]) if req["body"] else None)
    if req["path"] in OTHER_SERVERS:
        assert r.status_code == 404
        return
    assert r.status_code == 200, r.text
    if req["path"] != "/v1/chat/completions":
        return
    body = req["body"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "23 + 45 = 68. <answer>68</answer>"
    assert chunks[-1]["usage"]["completion_tokens"] == len(tok.encode(text)) + 1  # + EOS
    prompt = engine.prompts[0]
    assert '"name": "todo"' in prompt  # the tool, in the Hermes system block
    for m in body["messages"]:  # a tool turn: Hermes' result reaches the prompt verbatim
        if m["role"] == "tool":
            assert f"<tool_response>\n{m['content']}\n</tool_response>" in prompt


CAMEL = FIXTURES / "camel" / "multiply.json"


@pytest.mark.parametrize("name,req", _requests(CAMEL), ids=[n for n, _ in _requests(CAMEL)])
def test_camel_agents_recorded_requests_are_answered(name, req):
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "The result is 1474772. <answer>1474772</answer>")
    with serve_app(openai_app(engine, tok, "policy", max_model_len=1_000_000)) as url:
        r = httpx.request(req["method"], f"{url}{req['path']}", headers=req["headers"],
                          content=json.dumps(req["body"]))
    assert r.status_code == 200, r.text
    body = req["body"]
    if req["path"] == "/v1/messages/count_tokens":
        # the system text and the user turn, counted by the served tokenizer (one byte, one
        # token here), plus the chat template's markup around them
        assert r.json()["input_tokens"] > len(body["system"]) + len(body["messages"][0]["content"])
        return
    assert r.json()["choices"][0]["message"]["content"] == \
        "The result is 1474772. <answer>1474772</answer>"
    prompt = engine.prompts[0]
    assert '"name": "multiply"' in prompt
    tool_results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    assert tool_results in ([], ["1474772"])  # 718 * 2054, the tool's answer, reached the model
    for text in tool_results:
        assert f"<tool_response>\n{text}\n</tool_response>" in prompt


OPENCLAW = FIXTURES / "openclaw" / "add.json"


@pytest.mark.parametrize("name,req", _requests(OPENCLAW),
                         ids=[n for n, _ in _requests(OPENCLAW)])
def test_openclaws_recorded_requests_are_answered(name, req):
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "12 + 34 = 46. <answer>46</answer>")
    with serve_app(openai_app(engine, tok, "policy", max_model_len=1_000_000)) as url:
        r = httpx.request(req["method"], f"{url}{req['path']}", headers=req["headers"],
                          content=json.dumps(req["body"]))
    assert r.status_code == 200, r.text
    body = req["body"]
    # OpenClaw streams with usage and names its output budget max_completion_tokens.
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["tool_choice"], body["max_completion_tokens"]) == ("auto", 256)
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "12 + 34 = 46. <answer>46</answer>"
    assert chunks[-1]["usage"]["completion_tokens"] == len(tok.encode(text)) + 1  # + EOS
    [prompt] = engine.prompts
    assert chunks[-1]["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    for tool in body["tools"]:  # every tool's schema, in the Hermes system block
        assert f'"name": "{tool["function"]["name"]}"' in prompt
    for m in body["messages"]:  # every turn reaches the prompt: text parts, tool results
        parts = [m["content"]] if isinstance(m["content"], str) else \
            [p["text"] for p in m["content"] or []]
        assert all(p in prompt for p in parts)
        if m["role"] == "tool":
            assert f"<tool_response>\n{m['content']}\n</tool_response>" in prompt
