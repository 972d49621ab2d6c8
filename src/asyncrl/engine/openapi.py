"""The OpenAPI 3 description of an inference server's data plane, served at /openapi.json.

It covers what clients and agents call: /health, /version, /generate and the OpenAI routes
(/v1/models, /v1/completions, /v1/chat/completions). The control routes (pause, resume,
weight updates) are the trainer's and are left out. Bodies list the fields the server reads;
anything else is refused with 400, which fuzzers (schemathesis) exercise.
"""

from __future__ import annotations

from typing import Any

_INT_LIST = {"type": "array", "items": {"type": "integer"}}
_ERROR = {"description": "the request was refused; the body names the field",
          "content": {"application/json": {"schema": {"type": "object"}}}}
_OK = {"description": "the result", "content": {"application/json": {"schema": {
    "type": "object"}}}}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_OPENAI_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "stop": _STOP,
    "seed": {"type": "integer"},
    "stream": {"type": "boolean"},
    "logprobs": {"type": "boolean"},
}


def _post(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": properties, "required": required,
            "additionalProperties": False}}}},
        "responses": {"200": _OK, "400": _ERROR, "401": _ERROR, "413": _ERROR,
                      "503": _ERROR}}}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": _OK, "401": _ERROR,
                                                      "503": _ERROR}}}


def openapi(model_name: str, *, api_key: bool) -> dict[str, Any]:
    """The description; `api_key`: the server takes a bearer key (all but /health)."""
    spec: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": f"asyncrl inference server ({model_name})", "version": "1"},
        "paths": {
            "/health": _get("200 when the engine serves"),
            "/version": _get("the weight version served"),
            "/v1/models": _get("the served model"),
            "/generate": _post("token ids in, token ids and log-probs out", {
                "rid": {"type": "string"},
                "input_ids": _INT_LIST | {"minItems": 1},
                "sampling": {"type": "object", "additionalProperties": False, "properties": {
                    "max_new_tokens": {"type": "integer", "minimum": 1},
                    "temperature": {"type": "number", "minimum": 0},
                    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
                    "top_k": {"type": "integer", "minimum": 0},
                    "stop_token_ids": _INT_LIST,
                    "stop": {"type": "array", "items": {"type": "string"}},
                    "ignore_eos": {"type": "boolean"},
                    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}}},
            }, ["input_ids"]),
            "/v1/completions": _post("OpenAI text completions", _OPENAI_SAMPLING | {
                "prompt": {"oneOf": [{"type": "string"}, _INT_LIST]},
            }, ["prompt"]),
            "/v1/chat/completions": _post("OpenAI chat completions", _OPENAI_SAMPLING | {
                "messages": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["role", "content"], "properties": {
                        "role": {"type": "string",
                                 "enum": ["system", "user", "assistant", "tool"]},
                        "content": {"type": "string"}}}},
            }, ["messages"]),
        },
    }
    if api_key:
        spec["components"] = {"securitySchemes": {"bearer": {"type": "http",
                                                             "scheme": "bearer"}}}
        spec["security"] = [{"bearer": []}]
        spec["paths"]["/health"]["get"]["security"] = []
    return spec
