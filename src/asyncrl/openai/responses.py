"""POST /v1/responses (OpenAI's Responses API) answered by one chat completion.

The OpenAI Agents SDK calls this route by default. We keep no state between calls, so the
client sends the whole conversation in `input` each time (as the Agents SDK does unless it
is told to chain responses); `previous_response_id`, `conversation` and `prompt` (stored
server-side objects) and `background` are rejected. Each field's treatment (translated,
ignored with a note, refused) is in `compat.RESPONSES`, each input item type's in
`compat.RESPONSES_ITEMS`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from asyncrl.openai import compat
from asyncrl.openai.errors import OpenAIError
from asyncrl.openai.shapes_base import (
    ChatFn,
    ask_chat,
    chat_function,
    extension,
    new_id,
    only_choice,
    positive_int,
    read_body,
    send_events,
)

_MESSAGE_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text"}


class ResponsesRoutes:
    """POST /v1/responses over a chat callable."""

    def __init__(self, chat: ChatFn, model_name: str):
        self.chat = chat
        self.model_name = model_name

    def add_to(self, app: web.Application) -> None:
        """Mount the route on `app`."""
        app.add_routes([web.post("/v1/responses", self.create)])

    async def create(self, request: web.Request) -> web.StreamResponse:
        """Answer one Responses request (JSON, or SSE when `stream` is true)."""
        try:
            body = await read_body(request)
            answer = await ask_chat(self.chat, request, to_chat(body))
        except OpenAIError as e:
            return web.json_response(_renamed(e).body(), status=e.status)
        response = response_object(body, answer, self.model_name)
        if body.get("stream"):
            return await send_events(request, stream_events(response))
        return web.json_response(response)


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat error's `param` in this API's names (messages -> input, and so on)."""
    param = e.param or ""
    if param.startswith("messages"):
        e.param = "input"
    elif param in ("max_tokens", "max_completion_tokens"):
        e.param = "max_output_tokens"
    return e


# ---- request: Responses -> chat ------------------------------------------------------------

def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The /v1/chat/completions body (stream false) that answers a Responses body."""
    compat.check(body, compat.RESPONSES, "/v1/responses")
    _check_text_format(body.get("text"))
    if body.get("top_logprobs") not in (None, 0):
        raise OpenAIError("top_logprobs > 0 asks for top-k alternatives, which this engine does "
                          "not compute", param="top_logprobs")
    if not isinstance(body.get("stream", False), bool):
        raise OpenAIError("stream must be true or false", param="stream")
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError("instructions must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": False}
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    max_tokens = positive_int(body, "max_output_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def _check_text_format(text: Any) -> None:
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or (
            fmt is not None and fmt != {"type": "text"}):
        raise OpenAIError(f"text.format must be {{\"type\": \"text\"}} (structured output is "
                          f"not supported), got {text!r}", param="text.format")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages for `input`: a string, or a list of message / function_call / output items."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise OpenAIError("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        compat.kind(compat.RESPONSES_ITEMS, kind, "/v1/responses", f"{where}.type")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        # reasoning items (another model's) are dropped: compat.RESPONSES_ITEMS
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise OpenAIError(f"{where}.role must be one of {sorted(_MESSAGE_ROLES)}, got {role!r}",
                          param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                         for p in content):
        return {"role": role, "content": _parts(content, f"{where}.content", role)}
    return {"role": role, "content": _text(content, f"{where}.content")}


def _parts(content: list[Any], where: str, role: str) -> list[dict[str, Any]]:
    """Text and input_image parts as chat's text and image_url parts (the chat layer reads
    the images, or refuses them for a model that reads text only)."""
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if role != "user":
                raise OpenAIError(f"{at}: input_image parts are for user messages", param=at)
            if part.get("file_id") is not None:
                raise OpenAIError(f"{at}.file_id: this server stores no files; inline the "
                                  "image as image_url: data:image/png;base64,<its bytes>",
                                  param=f"{at}.file_id")
            url = part.get("image_url")
            if not isinstance(url, str):
                raise OpenAIError(f"{at}.image_url must be a string: a data URL",
                                  param=f"{at}.image_url")
            # detail (low / high / auto) sets an image's token budget in OpenAI's models;
            # here the model's processor fixes it
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            out.append({"type": "text", "text": _text_part(part, at)})
    return out


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined as they are (as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts", param=where)
    return "".join(_text_part(part, f"{where}[{j}]") for j, part in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(
            part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise OpenAIError(f"{where} is a {kind!r} part; only input_text, output_text and "
                          "(user turns) input_image parts are supported", param=where)
    return part["text"]


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """Join a function_call to the assistant turn before it, as the model wrote them together."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise OpenAIError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise OpenAIError(f"{where}.call_id must be a string", param=f"{where}.call_id")
    return {"role": "tool", "tool_call_id": item["call_id"],
            "content": _text(item.get("output"), f"{where}.output")}


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools as chat tools (`strict` has no meaning without
    constrained decoding, so it is dropped)."""
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise OpenAIError(f"tools[{i}].type {kind!r} is not supported; only function tools",
                              param=f"tools[{i}].type")
        out.append(chat_function(t.get("name"), t.get("description"), t.get("parameters"),
                                 f"tools[{i}]"))
    return out


def chat_tool_choice(choice: Any) -> Any:
    """none / auto / required, or {type: function, name} as chat's named function."""
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice must be none, auto, required or {{type: function, name}}, "
                      f"got {choice!r}", param="tool_choice")


# ---- answer: chat -> Response --------------------------------------------------------------

def response_object(body: dict[str, Any], answer: dict[str, Any], model_name: str) -> dict:
    """The Response object for a finished chat answer."""
    choice = only_choice(answer)
    incomplete = choice.get("finish_reason") == "length"
    message = choice["message"]
    text, calls = message.get("content"), message.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append({"id": new_id("msg"), "type": "message", "role": "assistant",
                       "status": "incomplete" if incomplete else "completed",
                       "content": [{"type": "output_text", "text": text or "",
                                    "annotations": []}]})
    for call in calls:
        output.append({"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    usage = answer.get("usage") or {}
    inputs, outputs = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "id": new_id("resp"), "object": "response",
        "created_at": answer.get("created", int(time.time())),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "model": model_name, "output": output,
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": [_echo_tool(t) for t in body.get("tools") or []], "truncation": "disabled",
        "usage": {"input_tokens": inputs, "output_tokens": outputs,
                  "total_tokens": usage.get("total_tokens", inputs + outputs),
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "user": body.get("user"), "metadata": body.get("metadata") or {},
        **extension(choice),
    }


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def stream_events(response: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    """The finished `response` as the Responses event stream, numbered from 0."""
    for seq, (kind, data) in enumerate(_events(response)):
        yield kind, {"type": kind, "sequence_number": seq, **data}


def _events(response: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    start = {**response, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None}
    yield "response.created", {"response": start}
    yield "response.in_progress", {"response": start}
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield from _message_events(index, item)
        else:
            yield from _call_events(index, item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield done, {"response": response}


def _message_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    at = {"item_id": item["id"], "output_index": index}
    part = item["content"][0]
    yield "response.output_item.added", {"output_index": index,
                                         "item": {**item, "status": "in_progress", "content": []}}
    yield "response.content_part.added", {**at, "content_index": 0,
                                          "part": {**part, "text": ""}}
    if part["text"]:
        yield "response.output_text.delta", {**at, "content_index": 0, "delta": part["text"],
                                             "logprobs": []}
    yield "response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                        "logprobs": []}
    yield "response.content_part.done", {**at, "content_index": 0, "part": part}
    yield "response.output_item.done", {"output_index": index, "item": item}


def _call_events(index: int, item: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    at = {"item_id": item["id"], "output_index": index}
    yield "response.output_item.added", {"output_index": index, "item": {
        **item, "arguments": "", "status": "in_progress"}}
    yield "response.function_call_arguments.delta", {**at, "delta": item["arguments"]}
    yield "response.function_call_arguments.done", {**at, "name": item["name"],
                                                    "arguments": item["arguments"]}
    yield "response.output_item.done", {"output_index": index, "item": item}
