"""POST /v1/messages (Anthropic's Messages API) answered by one chat completion.

For Claude-Code-style agent runtimes. Translated: `model`, `max_tokens` (required),
`system`, `messages` (text, tool_use and tool_result blocks), `tools` (custom tools with an
`input_schema`), `tool_choice`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`.
Accepted and ignored: `metadata`, `service_tier`, `cache_control` (top level and on blocks),
and `thinking`: the served model has no separate thinking channel, so the answer simply has
no thinking blocks (a well-formed answer), and thinking blocks sent back in the history are
dropped. Anything else, and content other than text / tool_use / tool_result (images,
documents, server tools), is a 400 naming the field.

Text blocks of one turn are joined as they are, as the chat route joins text parts. A
tool_result with `is_error` reaches the model as "Error: " + its text (chat tool messages
have no error flag). `stop_reason` is "stop_sequence" only when the chat choice names the
stop string that matched in a `stop_reason` field (vLLM's extension); otherwise a stop is
"end_turn". Authentication is the server's: Anthropic clients send `x-api-key`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from asyncrl.openai.protocol import OpenAIError
from asyncrl.openai.shapes_base import (
    ChatFn,
    ask_chat,
    chat_function,
    check_fields,
    extension,
    new_id,
    only_choice,
    parse_arguments,
    positive_int,
    read_body,
    send_events,
)
from asyncrl.openai.tool_calls import CLOSE, OPEN

_TRANSLATED = {"model", "max_tokens", "system", "messages", "tools", "tool_choice",
               "stop_sequences", "temperature", "top_p", "top_k", "stream"}
_IGNORED = {"metadata", "service_tier", "cache_control", "thinking"}
FIELDS = _TRANSLATED | _IGNORED
_BLOCKS = {"user": {"text", "tool_result"},
           "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicRoutes:
    """POST /v1/messages over a chat callable."""

    def __init__(self, chat: ChatFn, model_name: str):
        self.chat = chat
        self.model_name = model_name

    def add_to(self, app: web.Application) -> None:
        """Mount the route on `app`."""
        app.add_routes([web.post("/v1/messages", self.create)])

    async def create(self, request: web.Request) -> web.StreamResponse:
        """Answer one Messages request (JSON, or SSE when `stream` is true)."""
        try:
            body = await read_body(request)
            answer = await ask_chat(self.chat, request, to_chat(body))
        except OpenAIError as e:
            return web.json_response(error_body(e), status=e.status)
        message = message_object(body, answer, self.model_name)
        if body.get("stream"):
            return await send_events(request, stream_events(message))
        return web.json_response(message)


def error_body(e: OpenAIError) -> dict[str, Any]:
    """Anthropic's error shape; the message names the field, as there is no `param`."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    text = str(e)
    param = {"messages": "messages", "stop": "stop_sequences"}.get(e.param or "", e.param)
    if param and param not in text:
        text = f"{param}: {text}"
    return {"type": "error", "error": {"type": kind, "message": text}}


# ---- request: Messages -> chat -------------------------------------------------------------

def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The /v1/chat/completions body (stream false) that answers a Messages body."""
    check_fields(body, FIELDS)
    max_tokens = positive_int(body, "max_tokens", required=True)
    if not isinstance(body.get("stream", False), bool):
        raise OpenAIError("stream must be true or false", param="stream")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(raw):
        messages.extend(_turn(m, f"messages[{i}]"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "max_tokens": max_tokens, "stream": False}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def _blocks(content: Any, where: str, allowed: set[str]) -> list[dict[str, Any]]:
    """Content as a checked list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content blocks", param=where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise OpenAIError(f"{where}[{j}].type {kind!r} is not supported here; use one of "
                              f"{sorted(allowed)}", param=f"{where}[{j}].type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise OpenAIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
    return content


def _text(content: Any, where: str) -> str:
    return "".join(b["text"] for b in _blocks(content, where, {"text"}))


def _turn(m: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Messages turn."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in _BLOCKS:
        raise OpenAIError(f"{where}.role must be user or assistant, got {role!r}",
                          param=f"{where}.role")
    blocks = _blocks(m.get("content"), f"{where}.content", _BLOCKS[role])
    if role == "assistant":
        return [_assistant(blocks, f"{where}.content")]
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):  # tool results and text keep their order
        if block["type"] == "tool_result":
            out.append(_tool_result(block, f"{where}.content[{j}]"))
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block["text"]
        else:
            out.append({"role": "user", "content": block["text"]})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    calls = []
    for j, b in enumerate(blocks):
        if b["type"] != "tool_use":
            continue
        if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                not isinstance(b.get("input"), dict):
            raise OpenAIError(f"{where}[{j}] must be {{type: tool_use, id, name, input (an "
                              "object)}", param=f"{where}[{j}]")
        calls.append({"id": b["id"], "type": "function", "function": {
            "name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""  # e.g. only thinking blocks, which are dropped
    return message


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise OpenAIError(f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools {name, description, input_schema} as chat tools."""
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(
                t.get("input_schema"), dict):
            kind = t.get("type") if isinstance(t, dict) else None
            raise OpenAIError(f"tools[{i}] must be a custom tool {{name, description, "
                              f"input_schema}}; server tools (type {kind!r}) are not supported",
                              param=f"tools[{i}]")
        out.append(chat_function(t.get("name"), t.get("description"), t["input_schema"],
                                 f"tools[{i}]"))
    return out


def chat_tool_choice(choice: Any) -> Any:
    """{type: auto|any|tool|none} as chat's auto / required / named function / none."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    simple = {"auto": "auto", "any": "required", "none": "none"}
    if kind in simple:
        return simple[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice must be {{type: auto|any|none}} or {{type: tool, name}}, "
                      f"got {choice!r}", param="tool_choice")


# ---- answer: chat -> Message ---------------------------------------------------------------

def message_object(body: dict[str, Any], answer: dict[str, Any], model_name: str) -> dict:
    """The Message object for a finished chat answer."""
    choice = only_choice(answer)
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content.extend(_tool_use(call) for call in message.get("tool_calls") or [])
    stop_reason = _STOP_REASONS.get(choice.get("finish_reason"), "end_turn")
    stop_sequence = choice.get("stop_reason")
    if stop_reason == "end_turn" and stop_sequence in (body.get("stop_sequences") or []):
        stop_reason = "stop_sequence"
    else:
        stop_sequence = None
    usage = answer.get("usage") or {}
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0),
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            **extension(choice)}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A tool_use block; a call whose arguments are no JSON object stays visible as text."""
    fn = call["function"]
    args = parse_arguments(fn["arguments"])
    if args is None:
        raw = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
        return {"type": "text", "text": f"{OPEN}\n{raw}\n{CLOSE}"}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def stream_events(message: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    """The finished `message` as Anthropic's event stream."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta",
                                                          "text": block["text"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta",
                     "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        yield "content_block_start", {"type": "content_block_start", "index": index,
                                      "content_block": first}
        yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                      "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": message["stop_reason"],
                                      "stop_sequence": message["stop_sequence"]},
                            "usage": {"output_tokens": message["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}
