"""What the Responses and Anthropic Messages routes share: both are translations onto chat.

Each route checks its own request shape, builds one non-streaming /v1/chat/completions
body, hands it to a `ChatFn` (whatever the server uses to answer chat), and writes the
chat.completion back in its own shape. A streamed request is answered by replaying the
finished chat answer as that API's server-sent events, so a stream costs the same single
generation and carries the same tokens.

    ResponsesRoutes(chat, model_name).add_to(app)          # POST /v1/responses (responses.py)
    AnthropicRoutes(chat, model_name, count).add_to(app)   # POST /v1/messages (anthropic.py)

Our extension fields (`prompt_token_ids`, `token_ids`, `token_logprobs`, `token_versions`,
see openai_api.py) travel as top-level keys of each answer; both SDKs keep
unknown keys in `model_extra`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from asyncrl.api.errors import InferenceError
from asyncrl.openai.errors import OpenAIError

ChatFn = Callable[[web.Request, dict], Awaitable[dict]]
"""(request, chat body with stream False) -> the chat.completion dict; raises OpenAIError."""
CountFn = Callable[[web.Request, dict], Awaitable[int]]
"""(request, chat body) -> the prompt token count it would be answered with; OpenAIError."""

EXTENSION_FIELDS = ("prompt_token_ids", "token_ids", "token_logprobs", "token_versions")


def new_id(prefix: str) -> str:
    """A fresh id in the API's style, e.g. `resp_3f2a...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def extension(choice: dict[str, Any]) -> dict[str, Any]:
    """The extension fields a chat choice carries (absent ones stay absent)."""
    return {k: choice[k] for k in EXTENSION_FIELDS if k in choice}


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, or an OpenAIError saying why not."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def positive_int(body: dict[str, Any], name: str, *, required: bool = False) -> int | None:
    """`body[name]` as an integer >= 1 (None when absent and not required)."""
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        what = "is required and" if value is None else "must be"
        raise OpenAIError(f"{name} {what} an integer >= 1, got {value!r}", param=name)
    return value


async def ask_chat(chat: ChatFn, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
    """`chat(request, body)`, with engine failures as 5xx OpenAIErrors (as the chat route does)."""
    try:
        return await chat(request, body)
    except InferenceError as e:  # a backend server failed or answered an error
        raise OpenAIError(f"the inference backend failed: {e}", status=502,
                          type="server_error") from None
    except RuntimeError as e:  # the local engine shut down or a step failed
        raise OpenAIError(f"generation failed: {e}", status=503, type="server_error") from None


def only_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The single choice of a chat answer (we never ask for n > 1)."""
    return answer["choices"][0]


def parse_arguments(arguments: str) -> dict[str, Any] | None:
    """Tool-call arguments as an object, or None when they are not a JSON object."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None


def chat_function(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A chat `tools` entry; keys the client left out stay out of the rendered prompt."""
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"{where}.name must be a non-empty string", param=f"{where}.name")
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its `event:` line (both SDKs dispatch on it)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def send_events(request: web.Request,
                      events: Iterable[tuple[str, dict]]) -> web.StreamResponse:
    """Answer `request` with `events` as a text/event-stream."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for event, data in events:
        await resp.write(sse(event, data))
    await resp.write_eof()
    return resp
