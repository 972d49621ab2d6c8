"""The OpenAI Responses and Anthropic Messages APIs, as translations onto chat completions.

Each route checks its own request shape, builds one non-streaming /v1/chat/completions
body, hands it to a `ChatFn` (whatever the server uses to answer chat), and writes the
chat.completion back in its own shape. A streamed request is answered by replaying the
finished chat answer as that API's server-sent events, so a stream costs the same single
generation and carries the same tokens.

    ResponsesRoutes(chat, model_name).add_to(app)   # POST /v1/responses   (responses_api.py)
    AnthropicRoutes(chat, model_name).add_to(app)   # POST /v1/messages    (anthropic_api.py)

A server without an in-process chat callable can use `HttpChat(url)`, which posts the
chat body to any /v1/chat/completions URL (its own, on loopback, or a gateway's).

Our extension fields (`prompt_token_ids`, `token_ids`, `token_logprobs`, `token_versions`,
see inference/openai_api.py) travel as top-level keys of each answer; both SDKs keep
unknown keys in `model_extra`.
"""

from asyncrl.services.anthropic_api import AnthropicRoutes
from asyncrl.services.responses_api import ResponsesRoutes
from asyncrl.services.shapes_base import EXTENSION_FIELDS, ChatFn, HttpChat

__all__ = ["EXTENSION_FIELDS", "AnthropicRoutes", "ChatFn", "HttpChat", "ResponsesRoutes"]
