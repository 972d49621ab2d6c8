"""POST /v1/messages (Anthropic's Messages API) answered by one chat completion.

For Claude-Code-style agent runtimes. Every field of Anthropic's request types is
accepted; `compat.MESSAGES` (fields), `compat.MESSAGE_ROLES` and `compat.MESSAGE_BLOCKS`
say which are translated, ignored (with a note logged once) or refused with a 400 naming
them. Any model name is answered by the served model. `role: "system"` messages inside
`messages` become system turns at their position (one with `clear_at:
"next_user_message"` only until a later user message exists). `context_management`:
thinking never reaches the served model, so clear_thinking edits hold as they are; a
clear_tool_uses or compact edit would rewrite the prompt once its trigger fires, which this
server does not do, so the request is a 400 when the trigger fires (its input-token count
or tool-use count reached) and is answered unchanged below it.

POST /v1/messages/count_tokens answers `{"input_tokens": n}`: the prompt token count of
the chat prompt the same body would be answered with. A prompt the model's context cannot
hold is a 400 in Anthropic's words ("prompt is too long: N tokens > M maximum").

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

from asyncrl.openai import compat
from asyncrl.openai.errors import ContextLengthError, OpenAIError
from asyncrl.openai.shapes_base import (
    ChatFn,
    CountFn,
    ask_chat,
    chat_function,
    extension,
    new_id,
    only_choice,
    parse_arguments,
    positive_int,
    read_body,
    send_events,
)
from asyncrl.openai.tool_calls import CLOSE, OPEN

_API = "/v1/messages"
_BLOCKS = {"user": {"text", "tool_result", "image"}, "assistant": {"text", "tool_use"},
           "system": {"text"}, "tool_result": {"text"}}
_TRIGGERS = {"clear_tool_uses_20250919": 100_000, "compact_20260112": 150_000}  # input tokens
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicRoutes:
    """POST /v1/messages and /v1/messages/count_tokens over a chat and a count callable."""

    def __init__(self, chat: ChatFn, model_name: str, count: CountFn, *,
                 reads_images: bool = False):
        """`reads_images`: the served model takes image blocks (else they are refused)."""
        self.chat = chat
        self.model_name = model_name
        self.count = count
        self.reads_images = reads_images

    def add_to(self, app: web.Application) -> None:
        """Mount the routes on `app`."""
        app.add_routes([web.post("/v1/messages", self.create),
                        web.post("/v1/messages/count_tokens", self.count_tokens)])

    async def create(self, request: web.Request) -> web.StreamResponse:
        """Answer one Messages request (JSON, or SSE when `stream` is true)."""
        try:
            body = await read_body(request)
            chat = to_chat(body, self.model_name, self.reads_images)
            await self._check_triggers(request, body, chat)
            if body["max_tokens"] == 0:  # the API's cache warm-up: nothing is generated
                answer = _nothing(await self.count(request, chat))
            else:
                answer = await ask_chat(self.chat, request, chat)
        except OpenAIError as e:
            return web.json_response(error_body(e), status=e.status)
        message = message_object(body, answer, self.model_name)
        if body.get("stream"):
            return await send_events(request, stream_events(message))
        return web.json_response(message)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """{"input_tokens": n}: the prompt tokens the same body would be answered with."""
        try:
            body = await read_body(request)
            chat = to_chat({"max_tokens": 1, **body}, self.model_name, self.reads_images)
            n = await self.count(request, chat)
        except OpenAIError as e:
            return web.json_response(error_body(e), status=e.status)
        return web.json_response({"input_tokens": n})

    async def _check_triggers(self, request: web.Request, body: dict[str, Any],
                              chat: dict[str, Any]) -> None:
        """400 when a context_management edit that rewrites the prompt would fire."""
        edits = [e for e in context_edits(body) if e["type"] in _TRIGGERS]
        if not edits:
            return
        tokens = await self.count(request, chat)
        uses = sum(len(m.get("tool_calls") or []) for m in chat["messages"])
        for i, edit in enumerate(edits):
            trigger = edit.get("trigger") or {"type": "input_tokens",
                                              "value": _TRIGGERS[edit["type"]]}
            have = tokens if trigger.get("type") == "input_tokens" else uses
            if not isinstance(trigger.get("value"), int) or trigger.get("type") not in (
                    "input_tokens", "tool_uses"):
                raise OpenAIError(f"context_management.edits[{i}].trigger must be {{type: "
                                  f"input_tokens|tool_uses, value: int}}, got {trigger!r}",
                                  param="context_management")
            if have >= trigger["value"]:
                raise OpenAIError(
                    f"context_management: the {edit['type']} edit fires here ({have} "
                    f"{trigger['type']} >= {trigger['value']}) and this server does not "
                    "rewrite prompts; clear or compact the conversation in the client, or "
                    "raise the trigger", param="context_management")


def error_body(e: OpenAIError) -> dict[str, Any]:
    """Anthropic's error shape; the message names the field, as there is no `param`."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    text = str(e)
    if isinstance(e, ContextLengthError):  # Anthropic's words, which Claude Code reads
        text = f"prompt is too long: {e.tokens} tokens > {e.limit - 1} maximum ({text})"
    param = {"messages": "messages", "stop": "stop_sequences"}.get(e.param or "", e.param)
    if param and param not in text:
        text = f"{param}: {text}"
    return {"type": "error", "error": {"type": kind, "message": text}}


# ---- request: Messages -> chat -------------------------------------------------------------

def to_chat(body: dict[str, Any], model_name: str, reads_images: bool = False) -> dict[str, Any]:
    """The /v1/chat/completions body (stream false) that answers a Messages body; image
    blocks become image_url parts where `reads_images`, else they are refused."""
    compat.check(body, compat.MESSAGES, _API)
    max_tokens = 1 if body.get("max_tokens") == 0 and not isinstance(body["max_tokens"], bool) \
        else positive_int(body, "max_tokens", required=True)
    if not isinstance(body.get("stream", False), bool):
        raise OpenAIError("stream must be true or false", param="stream")
    _check_output_config(body.get("output_config"))
    context_edits(body)
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    users = [i for i, m in enumerate(raw) if isinstance(m, dict) and m.get("role") == "user"]
    for i, m in enumerate(raw):
        later_user = bool(users) and users[-1] > i
        messages.extend(_turn(m, f"messages[{i}]", later_user, reads_images))
    chat: dict[str, Any] = {"model": model_name, "messages": messages,
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


def _check_output_config(config: Any) -> None:
    """effort and task_budget change nothing here; a format would need constrained decoding."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise OpenAIError("output_config must be an object", param="output_config")
    if config.get("format") is not None:
        raise OpenAIError("output_config.format is not supported: a JSON schema needs "
                          "constrained decoding, which this server does not do",
                          param="output_config.format")


def context_edits(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The checked `context_management.edits` of a Messages body ([] when absent)."""
    config = body.get("context_management")
    if config is None:
        return []
    edits = config.get("edits") if isinstance(config, dict) else None
    if not isinstance(edits, list) or not all(isinstance(e, dict) and e.get("type") in (
            "clear_thinking_20251015", *_TRIGGERS) for e in edits):
        raise OpenAIError("context_management must be {edits: [...]} of clear_thinking_20251015, "
                          f"clear_tool_uses_20250919 or compact_20260112 edits, got {config!r}",
                          param="context_management")
    return edits


def _blocks(content: Any, where: str, role: str,
            reads_images: bool = False) -> list[dict[str, Any]]:
    """Content as checked blocks this role may hold (a string is one text block); blocks
    that compat ignores (another model's thinking) are left out."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content blocks", param=where)
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        rule = compat.kind(compat.MESSAGE_BLOCKS, kind, _API, f"{where}[{j}].type")
        if rule.treatment == "ignored":
            continue
        if kind == "image" and not reads_images:
            compat.refuse_text_only(f"{where}[{j}].type", kind)
        if kind not in _BLOCKS[role]:
            raise OpenAIError(f"{where}[{j}].type {kind!r} cannot be in {role} content; use "
                              f"one of {sorted(_BLOCKS[role])}", param=f"{where}[{j}].type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise OpenAIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        out.append(block)
    return out


def _text(content: Any, where: str) -> str:
    return "".join(b["text"] for b in _blocks(content, where, "system"))


def _turn(m: Any, where: str, later_user: bool,
          reads_images: bool = False) -> list[dict[str, Any]]:
    """The chat messages of one Messages turn (none for a system message already cleared)."""
    role = m.get("role") if isinstance(m, dict) else None
    compat.kind(compat.MESSAGE_ROLES, role, _API, f"{where}.role", "role")
    if role == "system":
        clear_at = m.get("clear_at") or "never"
        if clear_at not in ("never", "next_user_message"):
            raise OpenAIError(f"{where}.clear_at must be never or next_user_message, got "
                              f"{clear_at!r}", param=f"{where}.clear_at")
        if clear_at == "next_user_message" and later_user:
            return []
        return [{"role": "system", "content": _text(m.get("content"), f"{where}.content")}]
    blocks = _blocks(m.get("content"), f"{where}.content", role, reads_images)
    if role == "assistant":
        return [_assistant(blocks, f"{where}.content")]
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):  # tool results, text and images keep their order
        if block["type"] == "tool_result":
            out.append(_tool_result(block, f"{where}.content[{j}]"))
            continue
        part = _image_part(block, f"{where}.content[{j}]") if block["type"] == "image" \
            else {"type": "text", "text": block["text"]}
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(part)
        else:
            out.append({"role": "user", "content": [part]})
    for m in out:  # text only: one string, as the text-only chat body always was
        if m["role"] == "user" and all(p["type"] == "text" for p in m["content"]):
            m["content"] = "".join(p["text"] for p in m["content"])
    return out


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block with a base64 source as the chat body's image_url part (a data URL)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url":
        raise OpenAIError(f"{where}.source: this server fetches no URLs; send the image as "
                          "{type: base64, media_type, data}", param=f"{where}.source")
    ok = isinstance(source, dict) and source.get("type") == "base64" and isinstance(
        source.get("data"), str) and str(source.get("media_type", "")).startswith("image/")
    if not ok:
        raise OpenAIError(f"{where}.source must be {{type: base64, media_type: image/..., "
                          "data}", param=f"{where}.source")
    url = f"data:{source['media_type']};base64,{source['data']}"
    return {"type": "image_url", "image_url": {"url": url}}


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
    text = "" if content is None else "".join(
        b["text"] for b in _blocks(content, f"{where}.content", "tool_result"))
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


def _nothing(prompt_tokens: int) -> dict[str, Any]:
    """The chat answer of a max_tokens 0 request: no tokens, stopped by the limit."""
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0}}


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
