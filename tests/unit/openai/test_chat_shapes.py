"""The Responses and Anthropic Messages routes over a fake chat callable, through the official SDKs.

The fake records the chat body each route built and answers a canned chat.completion, so
each test checks both directions of the translation: the chat request against a body
written by hand, and the answer as the `openai` / `anthropic` clients parse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest
from aiohttp import web
from openai.types.responses import Response
from serving import serving as serve_app

from asyncrl.api.errors import InferenceError
from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai.anthropic import AnthropicRoutes
from asyncrl.openai.protocol import OpenAIError
from asyncrl.openai.responses import ResponsesRoutes
from asyncrl.openai.routes import openai_app

MODEL = "served-model"
KEY = "sk-test"
EXT = {"prompt_token_ids": [1, 2, 3], "token_ids": [7, 8], "token_logprobs": [-0.5, -0.25],
       "token_versions": [4, 4]}
WEATHER_CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat_answer(content: str | None, calls: list[tuple[str, str, str]] = (),
                finish: str = "stop", **extra: Any) -> dict[str, Any]:
    """A chat.completion with one choice; calls are (id, name, arguments JSON)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
            "model": MODEL, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                         "logprobs": None, **EXT, **extra}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


TEXT = chat_answer("It is sunny.")
CALL = chat_answer(None, [("call_1", "get_weather", '{"city": "Paris"}')], "tool_calls")
TRUNCATED = chat_answer("It is sun", finish="length")


class FakeChat:
    """Answers the scripted chat answers in turn (the last one repeats); records the bodies."""

    def __init__(self, *answers: dict[str, Any] | Exception):
        self.answers = list(answers)
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class FakeCount:
    """A `CountFn` that answers `tokens` for every body; records the bodies."""

    def __init__(self, tokens: int = 0):
        self.tokens = tokens
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, request: web.Request, body: dict[str, Any]) -> int:
        self.bodies.append(body)
        return self.tokens


def shapes_app(chat: Any, count: Any = None) -> web.Application:
    app = web.Application()
    ResponsesRoutes(chat, MODEL).add_to(app)
    AnthropicRoutes(chat, MODEL, count or FakeCount()).add_to(app)
    return app


@contextlib.contextmanager
def serving(chat: Any, app: web.Application | None = None) -> Iterator[str]:
    """Both routes over `chat` (or `app`) on a free loopback port; yields the URL."""
    with serve_app(app or shapes_app(chat)) as url:
        yield url


class HttpChat:
    """A `ChatFn` that posts to a /v1/chat/completions URL, passing the caller's API key on."""

    def __init__(self, url: str):
        self.url = url

    async def __call__(self, request: web.Request, body: dict) -> dict:
        key = request.headers.get("Authorization") or f"Bearer {request.headers['x-api-key']}"
        async with aiohttp.ClientSession() as session, session.post(
                self.url, json=body, headers={"Authorization": key}) as resp:
            answer = await resp.json(content_type=None)
        if resp.status != 200:
            err = answer["error"]
            raise OpenAIError(err["message"], status=resp.status, param=err.get("param"),
                              type=err["type"], code=err.get("code"))
        return answer


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)


# ---- Responses API -------------------------------------------------------------------------

def test_responses_string_input_becomes_a_user_message_after_the_instructions():
    chat = FakeChat(TEXT)
    with serving(chat) as url:
        resp = asyncio.run(oai(url).responses.create(
            model=MODEL, input="Weather in Paris?", instructions="Be brief.",
            max_output_tokens=50, temperature=0.5, store=False, metadata={"run": "1"}))
    assert chat.bodies == [{"model": MODEL, "stream": False, "max_tokens": 50,
                            "temperature": 0.5,
                            "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Weather in Paris?"}]}]
    assert resp.status == "completed" and resp.output_text == "It is sunny."
    assert resp.id.startswith("resp_") and resp.model == MODEL
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (3, 2, 5)
    assert {k: resp.model_extra[k] for k in EXT} == EXT


def test_responses_history_of_calls_and_outputs_maps_to_chat_tool_calls_and_tool_messages():
    chat = FakeChat(CALL)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": WEATHER_CHAT_TOOL["function"]["parameters"], "strict": False}]
    history = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Rome?"}]},
        {"type": "message", "role": "assistant", "id": "msg_0", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_0", "call_id": "call_0", "name": "get_weather",
         "arguments": '{"city": "Rome"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_0", "output": "22C"},
        {"role": "user", "content": "And Paris?"},
    ]
    with serving(chat) as url:
        resp = asyncio.run(oai(url).responses.create(
            model=MODEL, input=history, tools=tools, parallel_tool_calls=False,
            tool_choice={"type": "function", "name": "get_weather"}))
    assert chat.bodies == [{"model": MODEL, "stream": False, "tools": [WEATHER_CHAT_TOOL],
                            "tool_choice": {"type": "function",
                                            "function": {"name": "get_weather"}},
                            "messages": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "22C"},
        {"role": "user", "content": "And Paris?"}]}]
    [call] = resp.output
    assert (call.type, call.call_id, call.name, call.status) == (
        "function_call", "call_1", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert resp.tools[0].name == "get_weather" and resp.parallel_tool_calls is False


def test_responses_answer_cut_by_the_token_limit_is_incomplete():
    with serving(FakeChat(TRUNCATED)) as url:
        resp = asyncio.run(oai(url).responses.create(model=MODEL, input="hi",
                                                     max_output_tokens=3))
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "It is sun" and resp.output[0].status == "incomplete"


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]
CALL_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.function_call_arguments.delta", "response.function_call_arguments.done",
               "response.output_item.done", "response.completed"]


@pytest.mark.parametrize("answer,expected", [(TEXT, TEXT_EVENTS), (CALL, CALL_EVENTS)])
def test_responses_stream_replays_the_answer_as_numbered_sdk_events(answer, expected):
    async def run(url: str) -> tuple[list, Response]:
        client = oai(url)
        events = [e async for e in await client.responses.create(
            model=MODEL, input="hi", stream=True)]
        # The SDK's stream helper rebuilds the response from the events, checking their order.
        async with client.responses.stream(model=MODEL, input="hi") as stream:
            final = await stream.get_final_response()
        return events, final

    with serving(FakeChat(answer)) as url:
        events, final = asyncio.run(run(url))
    assert [e.type for e in events] == expected
    assert [e.sequence_number for e in events] == list(range(len(expected)))
    done = events[-1].response
    assert len(final.output) == 1 and final.output[0].type == done.output[0].type
    assert final.model_extra["token_ids"] == EXT["token_ids"]
    if answer is TEXT:
        assert events[4].delta == "It is sunny." and final.output_text == "It is sunny."
    else:
        assert events[4].arguments == '{"city": "Paris"}'
        assert final.output[0].call_id == "call_1"


@pytest.mark.parametrize("answer", [TEXT, CALL, TRUNCATED])
def test_responses_route_output_validates_against_the_sdk_model(answer):
    with serving(FakeChat(answer)) as url:
        raw = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    Response.model_validate(raw)  # the SDK's client is lenient; this checks required fields


@pytest.mark.parametrize("extra,param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].image_url"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_responses_bad_request_is_a_400_naming_the_field(extra, param):
    chat = FakeChat(TEXT)
    with serving(chat) as url:
        r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400 and chat.bodies == []
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_responses_chat_error_comes_back_with_the_responses_field_name():
    chat = FakeChat(OpenAIError("max_tokens must be an integer >= 1", param="max_tokens"))
    with serving(chat) as url, pytest.raises(openai.BadRequestError) as e:
        asyncio.run(oai(url).responses.create(model=MODEL, input="hi"))
    assert e.value.status_code == 400 and e.value.param == "max_output_tokens"


# ---- Anthropic Messages API ----------------------------------------------------------------

WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": WEATHER_CHAT_TOOL["function"]["parameters"]}


def test_messages_history_with_tool_use_and_results_maps_to_chat_messages():
    chat = FakeChat(CALL)
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_0", "name": "get_weather",
             "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_0",
             "content": [{"type": "text", "text": "22C"}]},
            {"type": "text", "text": "And Paris?", "cache_control": {"type": "ephemeral"}}]},
    ]
    with serving(chat) as url:
        msg = asyncio.run(claude(url).messages.create(
            model=MODEL, max_tokens=64, messages=history, tools=[WEATHER_TOOL],
            system=[{"type": "text", "text": "Use tools."}], tool_choice={"type": "any"},
            stop_sequences=["###"], metadata={"user_id": "u1"},
            extra_body={"temperature": 0.7, "top_k": 20}))
    assert chat.bodies == [{"model": MODEL, "max_tokens": 64, "stream": False,
                            "tools": [WEATHER_CHAT_TOOL], "tool_choice": "required",
                            "stop": ["###"], "temperature": 0.7, "top_k": 20, "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_0", "content": "22C"},
        {"role": "user", "content": "And Paris?"}]}]
    assert msg.stop_reason == "tool_use" and msg.id.startswith("msg_")
    [use] = msg.content
    assert (use.type, use.id, use.name, use.input) == (
        "tool_use", "call_1", "get_weather", {"city": "Paris"})
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (3, 2)
    assert {k: msg.model_extra[k] for k in EXT} == EXT


def test_messages_error_tool_result_and_named_tool_choice():
    chat = FakeChat(TEXT)
    history = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True}]}]
    with serving(chat) as url:
        msg = asyncio.run(claude(url).messages.create(
            model=MODEL, max_tokens=8, messages=history, tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "get_weather"}))
    assert chat.bodies[0]["messages"] == [{"role": "tool", "tool_call_id": "t1",
                                           "content": "Error: boom"}]
    assert chat.bodies[0]["tool_choice"] == {"type": "function",
                                             "function": {"name": "get_weather"}}
    assert msg.stop_reason == "end_turn" and msg.content[0].text == "It is sunny."


@pytest.mark.parametrize("answer,reason,sequence", [
    (TRUNCATED, "max_tokens", None),
    (chat_answer("It is", stop_reason="###"), "stop_sequence", "###"),
])
def test_messages_stop_reason_follows_the_chat_finish(answer, reason, sequence):
    with serving(FakeChat(answer)) as url:
        msg = asyncio.run(claude(url).messages.create(
            model=MODEL, max_tokens=3, stop_sequences=["###"],
            messages=[{"role": "user", "content": "hi"}]))
    assert (msg.stop_reason, msg.stop_sequence) == (reason, sequence)


def test_messages_stream_replays_text_and_tool_use_for_the_sdk():
    answer = chat_answer("Let me check.", [("call_1", "get_weather", '{"city": "Paris"}')],
                         "tool_calls")

    async def run(url: str):
        client = claude(url)
        async with client.messages.stream(
                model=MODEL, max_tokens=64, tools=[WEATHER_TOOL],
                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        raw = await client.messages.create(model=MODEL, max_tokens=64, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        return texts, final, [e.type async for e in raw]

    with serving(FakeChat(answer)) as url:
        texts, final, kinds = asyncio.run(run(url))
    assert "".join(texts) == "Let me check."
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 2 and final.model_extra["token_ids"] == EXT["token_ids"]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     "frobnicate"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
])
def test_messages_bad_request_is_an_anthropic_400_naming_the_field(body, field):
    chat = FakeChat(TEXT)
    with serving(chat) as url:
        r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == 400 and chat.bodies == []
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_messages_chat_error_reaches_the_sdk_in_anthropic_shape():
    chat = FakeChat(OpenAIError("model 'claude-x' is not served here", param="model",
                                code="model_not_found"))
    with serving(chat) as url, pytest.raises(anthropic.BadRequestError) as e:
        asyncio.run(claude(url).messages.create(
            model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}]))
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "model" in e.value.body["error"]["message"]


@pytest.mark.parametrize("path,body,error", [
    ("/v1/responses", {"input": "hi"}, {"type": "server_error", "param": None, "code": None}),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
     {"type": "api_error"}),
])
def test_a_failed_backend_is_a_502_in_each_apis_shape(path, body, error):
    with serving(FakeChat(InferenceError("backend down"))) as url:
        r = httpx.post(f"{url}{path}", json={"model": MODEL, **body})
    assert r.status_code == 502
    got = r.json()["error"]
    assert "backend down" in got.pop("message") and got == error


# ---- over the real chat route, through HttpChat -------------------------------------------

class ScriptedEngine:
    """Answers each request with the tokens of the next reply; records the prompts it got."""

    def __init__(self, tokenizer, *replies: str):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        self.prompts.append(self.tokenizer.decode(req.input_ids))
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        ids = self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id]
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.5] * len(ids),
                                  output_versions=[3] * len(ids), stop_reason=StopReason.STOP)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_turns_render_the_same_prompt_as_the_chat_route_would():
    tok = make_tiny_tokenizer()
    engine = ScriptedEngine(tok, HERMES_CALL)
    chat_messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    responses_input = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    anthropic_messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": "sunny"}]}]
    tools = [{"type": "function", **WEATHER_CHAT_TOOL["function"]}]

    async def run(chat_url: str, url: str):
        direct = openai.AsyncOpenAI(base_url=f"{chat_url}/v1", api_key=KEY, max_retries=0)
        await direct.chat.completions.create(model=MODEL, messages=chat_messages,
                                             tools=[WEATHER_CHAT_TOOL])
        resp = await oai(url).responses.create(model=MODEL, input=responses_input, tools=tools)
        msg = await claude(url).messages.create(model=MODEL, max_tokens=100, tools=[WEATHER_TOOL],
                                                messages=anthropic_messages)
        return resp, msg

    with serving(None, openai_app(engine, tok, MODEL, api_key=KEY)) as chat_url, \
            serving(HttpChat(f"{chat_url}/v1/chat/completions")) as url:
        resp, msg = asyncio.run(run(chat_url, url))
    assert "<tool_response>\nsunny\n</tool_response>" in engine.prompts[0]
    assert engine.prompts == [engine.prompts[0]] * 3  # one rendering, whichever API asked
    assert (resp.output[0].name, json.loads(resp.output[0].arguments)) == (
        "get_weather", {"city": "Paris"})
    assert (msg.content[0].name, msg.content[0].input) == ("get_weather", {"city": "Paris"})
    assert msg.model_extra["token_versions"][0] == 3  # extension fields came through


# ---- the OpenAI Agents SDK end to end ------------------------------------------------------

def test_agents_sdk_runner_calls_the_tool_then_returns_the_final_text():
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return "sunny"

    chat = FakeChat(chat_answer(None, [("call_9", "get_weather", '{"city": "Paris"}')],
                                "tool_calls"),
                    chat_answer("Paris is sunny."))
    with serving(chat) as url:
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=oai(url))
        agent = agents.Agent(name="weather", instructions="Answer with the tool.",
                             tools=[get_weather], model=model)
        result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?"))
    assert seen == ["Paris"] and result.final_output == "Paris is sunny."
    second = chat.bodies[1]["messages"]
    assert second[0] == {"role": "system", "content": "Answer with the tool."}
    assert second[-2]["tool_calls"][0]["id"] == "call_9"
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_9"
    assert "sunny" in second[-1]["content"]
