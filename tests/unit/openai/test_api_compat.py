"""Every field the real APIs accept is classified, documented, and treated as classified.

The field lists are read from the installed `openai` and `anthropic` SDKs' request types at
test time, so a field a newer SDK adds fails here by name until `compat.py` classifies it.
"""

from __future__ import annotations

import json
import logging
import re
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import BetaContentBlockParam, BetaMessageParam
from anthropic.types.beta import message_count_tokens_params as beta_count_params
from anthropic.types.beta import message_create_params as beta_create_params
from anthropic.types.beta.beta_system_message_param import ContentBlock as SystemBlock
from openai.types import completion_create_params
from openai.types.chat import (
    ChatCompletionContentPartParam,
    ChatCompletionMessageParam,
)
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import ResponseInputItemParam, response_create_params
from serving import serving as serve_app
from test_chat_shapes import (
    MODEL,
    TEXT,
    FakeChat,
    FakeCount,
    ScriptedEngine,
    shapes_app,
)

from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai import compat
from asyncrl.openai.routes import openai_app

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "reference" / "api-compatibility.md"
CAPTURE = ROOT / "tests" / "fixtures" / "claude_code" / "say_hi.json"


def _flat(tp: Any) -> list[Any]:
    """The members of a (possibly Annotated, Required) union type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Annotated, typing.Required, typing.NotRequired):
        return _flat(typing.get_args(tp)[0])
    if origin is typing.Union:
        return [m for arg in typing.get_args(tp) for m in _flat(arg)]
    return [tp]


def _literal(member: Any, key: str) -> set[str]:
    """The literal values of `member`'s `key` field (a TypedDict or a pydantic model)."""
    if hasattr(member, "model_fields"):
        field = member.model_fields.get(key)
        tp = field.annotation if field else None
    else:
        tp = typing.get_type_hints(member).get(key)
    return {v for m in _flat(tp) for v in typing.get_args(m)} if tp is not None else set()


def _literals(union: Any, key: str = "type") -> set[str]:
    return {v for member in _flat(union) for v in _literal(member, key)}


def _keys(*typed_dicts: Any) -> set[str]:
    return {k for td in typed_dicts for k in typing.get_type_hints(td)}


SDK_FIELDS = [
    ("chat", compat.CHAT, _keys(chat_create_params.CompletionCreateParamsNonStreaming,
                                chat_create_params.CompletionCreateParamsStreaming)),
    ("completions", compat.COMPLETIONS,
     _keys(completion_create_params.CompletionCreateParamsNonStreaming,
           completion_create_params.CompletionCreateParamsStreaming)),
    ("responses", compat.RESPONSES,
     _keys(response_create_params.ResponseCreateParamsNonStreaming,
           response_create_params.ResponseCreateParamsStreaming)),
    ("messages", compat.MESSAGES,
     _keys(message_create_params.MessageCreateParamsNonStreaming,
           message_create_params.MessageCreateParamsStreaming,
           beta_create_params.MessageCreateParamsNonStreaming,
           beta_create_params.MessageCreateParamsStreaming)),
    ("count_tokens", compat.MESSAGES,
     _keys(message_count_tokens_params.MessageCountTokensParams,
           beta_count_params.MessageCountTokensParams)),
    ("chat roles", compat.CHAT_ROLES, _literals(ChatCompletionMessageParam, "role")),
    ("chat content parts", compat.CHAT_PARTS, _literals(ChatCompletionContentPartParam)),
    ("responses input items", compat.RESPONSES_ITEMS, _literals(ResponseInputItemParam)),
    ("messages roles", compat.MESSAGE_ROLES, _literals(BetaMessageParam, "role")),
    ("messages content blocks", compat.MESSAGE_BLOCKS,
     _literals(BetaContentBlockParam) | _literals(SystemBlock)),
]


@pytest.mark.parametrize("what,table,sdk", SDK_FIELDS, ids=[w for w, _, _ in SDK_FIELDS])
def test_every_field_the_sdk_sends_is_classified(what, table, sdk):
    assert len(sdk) >= 3, f"{what}: the SDK's types were not read"
    missing = sorted(sdk - set(table))
    assert not missing, f"{what}: the SDK accepts {missing}; classify them in compat.py"


def test_messages_keeps_the_sampling_fields_older_clients_send():
    assert {compat.MESSAGES[k].treatment for k in ("temperature", "top_p", "top_k")} == \
        {"translated"}


def test_docs_page_lists_every_classified_field_with_its_treatment():
    text = DOCS.read_text()
    assert text == compat.markdown(), \
        "regenerate: python -m asyncrl.openai.compat > docs/reference/api-compatibility.md"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == len(compat.SECTIONS)
    for section, (title, _, table) in zip(sections, compat.SECTIONS):
        rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", section, flags=re.M)
        assert section.startswith(title)
        assert dict(rows) == {k: r.treatment for k, r in table.items()}


# ---- /v1/messages: treatments ---------------------------------------------------------------

def _post(chat: FakeChat, body: dict, path: str = "/v1/messages",
          count: FakeCount | None = None) -> httpx.Response:
    with serve_app(shapes_app(chat, count)) as url:
        return httpx.post(f"{url}{path}", json=body)


HI = {"model": "claude-opus-4-8", "max_tokens": 16, "messages": [{"role": "user",
                                                                    "content": "hi"}]}


def test_an_ignored_field_is_noted_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_noted", set())
    chat = FakeChat(TEXT)
    body = {**HI, "metadata": {"user_id": "u"}, "speed": "fast", "thinking": {"type": "adaptive"}}
    with caplog.at_level(logging.INFO, logger="asyncrl.openai.compat"):
        for _ in range(3):
            assert _post(chat, body).status_code == 200
    notes = [r.getMessage() for r in caplog.records]
    assert sorted(n.split(" is accepted")[0] for n in notes) == [
        "/v1/messages: metadata", "/v1/messages: speed", "/v1/messages: thinking"]
    assert len(chat.bodies) == 3 and all(b["messages"] == [{"role": "user", "content": "hi"}]
                                         for b in chat.bodies)


@pytest.mark.parametrize("extra,param", [
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    ({"thread": {"type": "create"}}, "thread"),
    ({"compaction": {"type": "summarize"}}, "compaction"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "search_result", "source": "s", "title": "t", "content": []}]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": [
        {"type": "tool_addition", "tool": {}}]}]}, "messages[1].content[0].type"),
])
def test_a_field_that_would_change_the_answer_is_a_400_naming_it(extra, param):
    chat = FakeChat(TEXT)
    r = _post(chat, {**HI, **extra})
    assert r.status_code == 400 and chat.bodies == []
    assert r.json()["error"]["message"].startswith(f"{param} ")


def test_neutral_values_of_refused_fields_are_answered():
    chat = FakeChat(TEXT)
    r = _post(chat, {**HI, "mcp_servers": [], "thread": None, "output_config": {"effort": "high"}})
    assert r.status_code == 200 and len(chat.bodies) == 1


def test_claude_codes_system_messages_become_system_turns_where_they_stand():
    chat = FakeChat(TEXT)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "system", "content": "agents: claude"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t",
                                           "signature": "s"}, {"type": "text", "text": "b"}]},
        {"role": "system", "content": "gone after the next user turn",
         "clear_at": "next_user_message"},
        {"role": "user", "content": "c"},
        {"role": "system", "content": [{"type": "text", "text": "stays: no user turn after"}],
         "clear_at": "next_user_message", "output_config": {"effort": "low"}},
    ]
    r = _post(chat, {**HI, "system": "S", "messages": messages,
                     "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                       "keep": "all"}]}})
    assert r.status_code == 200
    assert chat.bodies[0]["model"] == MODEL and chat.bodies[0]["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "agents: claude"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "system", "content": "stays: no user turn after"}]


@pytest.mark.parametrize("edit,tokens,status", [
    ({"type": "clear_tool_uses_20250919"}, 99_999, 200),  # default trigger 100k tokens
    ({"type": "clear_tool_uses_20250919"}, 100_000, 400),
    ({"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50}}, 49, 200),
    ({"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50}}, 50, 400),
    ({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2}}, 0, 200),
    ({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1}}, 0, 400),
])
def test_a_prompt_rewriting_context_edit_is_refused_only_when_its_trigger_fires(
        edit, tokens, status):
    chat, count = FakeChat(TEXT), FakeCount(tokens)
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                   "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": "r"}]}]
    r = _post(chat, {**HI, "messages": messages, "context_management": {"edits": [edit]}},
              count=count)
    assert r.status_code == status and len(chat.bodies) == (status == 200)
    if status == 400:
        assert r.json()["error"]["message"].startswith(f"context_management: the {edit['type']}")


# ---- over the real chat route: counts and lengths -------------------------------------------

def test_count_tokens_equals_the_prompt_the_same_body_is_answered_with():
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "hello")
    body = {**HI, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "mid"},
                         {"role": "user", "content": [{"type": "text", "text": "there"}]}]}
    with serve_app(openai_app(engine, tok, MODEL, max_model_len=512)) as url:
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body)
        answer = httpx.post(f"{url}/v1/messages?beta=true", json=body)
    # ChatML of the tiny byte-level tokenizer: one token per byte, plus 2 per turn marker
    # (<|im_start|>, <|im_end|>), and <|im_start|> of the generation prompt.
    turns = [("system", "Be brief."), ("user", "hi"), ("system", "mid"), ("user", "there")]
    by_hand = sum(2 + len(f"{role}\n{text}") + 1 for role, text in turns) + 1 + len("assistant\n")
    assert answer.status_code == 200 and counted.status_code == 200
    assert counted.json() == {"input_tokens": by_hand}
    assert len(answer.json()["prompt_token_ids"]) == by_hand
    assert answer.json()["usage"]["input_tokens"] == by_hand


def test_a_prompt_the_context_cannot_hold_is_anthropics_prompt_too_long():
    tok = make_tiny_tokenizer()
    body = {**HI, "messages": [{"role": "user", "content": "x" * 100}]}
    with serve_app(openai_app(ScriptedEngine(tok, "hi"), tok, MODEL, max_model_len=64)) as url:
        r = httpx.post(f"{url}/v1/messages", json=body)
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body)
    n = 2 + len("user\n") + 100 + 1 + 1 + len("assistant\n")  # ChatML, one token per byte
    assert r.status_code == 400 and counted.json() == {"input_tokens": n}
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(f"prompt is too long: {n} tokens > 63 maximum")


def test_root_answers_a_head_request_without_a_key():
    tok = make_tiny_tokenizer()
    with serve_app(openai_app(ScriptedEngine(tok, "hi"), tok, MODEL, api_key="k")) as url:
        assert httpx.head(f"{url}/").status_code == 200
        assert httpx.post(f"{url}/v1/messages", json=HI).status_code == 401
        assert httpx.post(f"{url}/v1/messages", json=HI,
                          headers={"x-api-key": "k"}).status_code == 200


# ---- Claude Code's own requests -------------------------------------------------------------

def _captured() -> list[tuple[str, dict]]:
    runs = json.loads(CAPTURE.read_text())["runs"]
    return [(f"{run}-{i}", r) for run, reqs in runs.items() for i, r in enumerate(reqs)]


@pytest.mark.parametrize("name,req", _captured(), ids=[n for n, _ in _captured()])
def test_claude_codes_captured_requests_are_answered(name, req):
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "hi")
    with serve_app(openai_app(engine, tok, MODEL, max_model_len=32_768)) as url:
        r = httpx.request(req["method"], f"{url}{req['path']}?{req['query']}",
                          headers=req["headers"],
                          content=json.dumps(req["body"]) if req["body"] else None)
    assert r.status_code == 200, r.text
    if req["method"] == "POST":
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                  if line.startswith("data: ")]
        assert [e["type"] for e in events] == [
            "message_start", "content_block_start", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop"]
        assert events[2]["delta"]["text"] == "hi"
        prompt = engine.prompts[0]
        tools = [t["name"] for t in req["body"]["tools"]]
        assert all(f'"name": "{t}"' in prompt for t in tools)  # the Hermes tool block
        assert prompt.count("<|im_start|>system\n") == 1 + sum(
            m["role"] == "system" for m in req["body"]["messages"])
        blocks = [b for m in req["body"]["messages"] if isinstance(m["content"], list)
                  for b in m["content"]]
        for b in blocks:  # a tool turn: the call and its result, in the Hermes form
            if b["type"] == "tool_use":
                assert json.dumps({"name": b["name"], "arguments": b["input"]}) in prompt
            if b["type"] == "tool_result":
                text = b["content"] if isinstance(b["content"], str) else "".join(
                    part["text"] for part in b["content"])
                assert f"<tool_response>\n{text}\n</tool_response>" in prompt


def test_a_template_that_renders_system_only_first_gets_late_system_text_merged(
        monkeypatch, caplog):
    monkeypatch.setattr(compat, "_noted", set())
    tok = make_tiny_tokenizer()
    tok.chat_template = (  # Llama-2 style: a system turn anywhere but first is an error
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    engine = ScriptedEngine(tok, "ok")
    body = {**HI, "system": "S", "messages": [
        {"role": "user", "content": "a"}, {"role": "system", "content": "late"},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"},
        {"role": "system", "content": "last"}]}
    with caplog.at_level(logging.INFO, logger="asyncrl.openai.compat"), \
            serve_app(openai_app(engine, tok, MODEL, max_model_len=512)) as url:
        r = httpx.post(f"{url}/v1/messages", json=body)
    assert r.status_code == 200
    assert engine.prompts == ["[system]S[user]a[user]late\n\nb\n\nlast[assistant]c[assistant]"]
    [note] = [rec.getMessage() for rec in caplog.records]
    assert "system only first" in note and "merged into the next user message" in note


CHAT_HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", {**CHAT_HI, "reasoning_effort": "low", "verbosity": "low",
                              "prediction": {"type": "content", "content": "x"},
                              "presence_penalty": 0.0, "modalities": ["text"]}, 200, None),
    ("/v1/chat/completions", {**CHAT_HI, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("/v1/chat/completions", {**CHAT_HI, "web_search_options": {}}, 200, None),  # empty: unset
    ("/v1/chat/completions", {**CHAT_HI, "web_search_options": {"search_context_size": "low"}},
     400, "web_search_options"),
    ("/v1/chat/completions", {**CHAT_HI, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT_HI, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "messages[0].content[0].type"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 1, "user": "u"}, 200, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/responses", {"model": MODEL, "input": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "hi"}], "reasoning": {"effort": "low"}}, 200, None),
    ("/v1/responses", {"model": MODEL, "input": "hi", "context_management": [
        {"type": "compaction", "compact_threshold": 1000}]}, 400, "context_management"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, 400,
     "input[0].type"),
])
def test_openai_fields_are_answered_as_classified(path, body, status, param):
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "ok")
    with serve_app(openai_app(engine, tok, MODEL, max_model_len=512)) as url:
        r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param
    else:  # the ignored fields left the prompt as the plain request renders it
        assert engine.prompts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"] \
            if path != "/v1/completions" else engine.prompts == ["hi"]


def test_max_tokens_zero_generates_nothing_and_counts_the_prompt():
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, "never")
    with serve_app(openai_app(engine, tok, MODEL, max_model_len=512)) as url:
        r = httpx.post(f"{url}/v1/messages", json={**HI, "max_tokens": 0})
    n = 2 + len("user\nhi") + 1 + 1 + len("assistant\n")  # ChatML, one token per byte
    assert r.status_code == 200 and engine.prompts == []
    msg = r.json()
    assert (msg["content"], msg["stop_reason"]) == ([], "max_tokens")
    assert (msg["usage"]["input_tokens"], msg["usage"]["output_tokens"]) == (n, 0)


def test_a_model_is_retrieved_by_its_name_and_another_name_is_openais_404():
    tok = make_tiny_tokenizer()
    with serve_app(openai_app(ScriptedEngine(tok, "hi"), tok, MODEL, max_model_len=512)) as url:
        card = httpx.get(f"{url}/v1/models/{MODEL}").json()
        missing = httpx.get(f"{url}/v1/models/other")
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", 512)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
