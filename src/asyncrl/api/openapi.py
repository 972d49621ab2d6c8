"""OpenAPI 3 descriptions of our HTTP services, each served at its /openapi.json.

- the inference server (`inference_server`): /health, /version, /generate and the OpenAI
  routes; its control routes (pause, resume, weight updates) are the trainer's, left out;
- the OpenAI gateway (`gateway`): the OpenAI routes;
- the agent proxy (`agent_proxy`): its /rl/* session routes and the four generation APIs
  (chat, completions, responses, messages), each answered for a session's key;
- the training service (`training_service`): every route but the two that open network
  connections to an address from the body (/weights/connect, /weights/free_port).

Bodies list the fields each route reads; anything else is refused with 400. The tests
fuzz each service from its own description with schemathesis: no answer may be a 5xx.
"""

from __future__ import annotations

from typing import Any

_INT_LIST = {"type": "array", "items": {"type": "integer"}}
_OBJECT = {"type": "object"}
_JSON = {"application/json": {"schema": _OBJECT}}
_ERROR = {"description": "the request was refused; the body names the field", "content": _JSON}
_OK = {"description": "the result", "content": _JSON}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_REWARD = {"type": "number"}
_OPENAI_SAMPLING = {
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
_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"type": "string"}}}}
_STATUSES = ("200", "400", "401", "404", "409", "410", "413", "429", "503")


def _post(summary: str, properties: dict[str, Any], required: list[str] = (),
          *, binary: bool = False) -> dict[str, Any]:
    if binary:  # raw bytes (a safetensors batch)
        content = {"application/octet-stream": {"schema": {"type": "string",
                                                           "format": "binary"}}}
    else:
        content = {"application/json": {"schema": {
            "type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}}}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": content},
                     "responses": {"200": _OK} | {s: _ERROR for s in _STATUSES[1:]}}}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary,
                    "responses": {"200": _OK, "401": _ERROR, "503": _ERROR}}}


def _document(title: str, paths: dict[str, Any], *, api_key: bool,
              public: tuple[str, ...] = ("/health",)) -> dict[str, Any]:
    spec: dict[str, Any] = {"openapi": "3.0.3", "info": {"title": title, "version": "1"},
                            "paths": paths}
    if api_key:
        spec["components"] = {"securitySchemes": {"bearer": {"type": "http",
                                                             "scheme": "bearer"}}}
        spec["security"] = [{"bearer": []}]
        for path in public:
            if path in paths:
                for operation in paths[path].values():
                    operation["security"] = []
    return spec


_MESSAGES_BODY = {"model": {"type": "string"}, "messages": _MESSAGES,
                  "system": {"type": "string"}, "max_tokens": {"type": "integer"},
                  "temperature": {"type": "number"}, "stream": {"type": "boolean"}}


def openai_paths(model_name: str | None) -> dict[str, Any]:
    """/v1 routes of OpenAI's and Anthropic's APIs; `model_name` None: any name (Messages
    takes any name everywhere)."""
    model = {"type": "string"} if model_name is None else {"type": "string",
                                                           "enum": [model_name]}
    return {
        "/v1/models": _get("the served model"),
        "/v1/models/{model}": {"get": {
            "summary": "the served model's card by name (404 for another name; any name "
                       "under the agent proxy)",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": _OK, "401": _ERROR, "404": _ERROR}}},
        "/v1/completions": _post("OpenAI text completions", _OPENAI_SAMPLING | {
            "model": model, "prompt": {"oneOf": [{"type": "string"}, _INT_LIST]},
        }, ["model", "prompt"]),
        "/v1/chat/completions": _post("OpenAI chat completions", _OPENAI_SAMPLING | {
            "model": model, "messages": _MESSAGES}, ["model", "messages"]),
        "/v1/responses": _post("OpenAI Responses API", {
            "model": model, "input": {"oneOf": [{"type": "string"}, _MESSAGES]},
            "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer"},
            "temperature": {"type": "number"}, "stream": {"type": "boolean"}},
            ["model", "input"]),
        "/v1/messages": _post("Anthropic Messages API", _MESSAGES_BODY,
                              ["model", "messages", "max_tokens"]),
        "/v1/messages/count_tokens": _post("the prompt tokens of a Messages body",
                                           _MESSAGES_BODY, ["model", "messages"]),
    }


def inference_server(model_name: str, *, api_key: bool) -> dict[str, Any]:
    """The inference server's data plane; `api_key`: it takes a bearer key (not /health)."""
    return _document(f"asyncrl inference server ({model_name})", {
        "/health": _get("200 when the engine serves"),
        "/version": _get("the weight version served"),
        "/generate": _post("token ids in, token ids and log-probs out", {
            "rid": {"type": "string"},
            "input_ids": _INT_LIST | {"minItems": 1},
            "sampling": {"type": "object", "additionalProperties": False, "properties": {
                "max_new_tokens": {"type": "integer", "minimum": 1},
                "temperature": {"type": "number", "minimum": 0},
                "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                          "maximum": 1},
                "top_k": {"type": "integer", "minimum": 0},
                "stop_token_ids": _INT_LIST,
                "stop": {"type": "array", "items": {"type": "string"}},
                "ignore_eos": {"type": "boolean"},
                "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}}},
        }, ["input_ids"]),
    } | openai_paths(None), api_key=api_key)


def gateway(model_name: str, *, api_key: bool) -> dict[str, Any]:
    """The OpenAI gateway in front of any backend."""
    return _document(f"asyncrl OpenAI gateway ({model_name})", openai_paths(model_name),
                     api_key=api_key)


def agent_proxy(model_name: str) -> dict[str, Any]:
    """The agent proxy: /rl/* take the admin key (start_session, close_session, sessions)
    or a session's key; the generation routes take a session's key (any model name)."""
    session = {"session_id": {"type": "string"}}
    return _document(f"asyncrl agent proxy ({model_name})", {
        "/health": _get("sessions active and the weight version"),
        "/rl/start_session": _post("a new session and its key (admin key)", {
            "task_id": {"type": "string"}, "api_key": {"type": "string"},
            "sampling": _OBJECT, "admitted": {"type": "boolean"},
            "start_version": {"type": "integer"}}),
        "/rl/set_reward": _post("the reward of a completion (default: the last)", session | {
            "reward": _REWARD, "completion_id": {"type": "string"}}, ["reward"]),
        "/rl/end_session": _post("the agent is done; the session is scored", session),
        "/rl/close_session": _post("end and score a session (admin key)", session | {
            "reward": _REWARD, "failure": {"type": "string"}}),
        "/rl/sessions": _get("session counts and the active sessions (admin key)"),
        **openai_paths(None),
        "/untrained/v1/chat/completions": _post(
            "chat for a session's other party (a simulated user): its own sampling, never "
            "recorded or trained", _OPENAI_SAMPLING | {"model": {"type": "string"},
                                                       "messages": _MESSAGES},
            ["model", "messages"]),
    }, api_key=True)


def training_service(*, api_key: bool) -> dict[str, Any]:
    """One trainer rank's routes (the controller's), bar the two that dial out."""
    path = {"path": {"type": "string"}}
    return _document("asyncrl training service", {
        "/health": _get("200 while the process serves; whether it is initialised"),
        "/info": _get("rank, world size, optimiser steps taken"),
        "/initialize": _post("load and shard the models", {
            "total_steps": {"type": "integer", "minimum": 1}}, ["total_steps"]),
        "/train": _post("one RL step on a safetensors batch", {}, binary=True),
        "/compute_logprobs": _post("the actor's log-probs of a safetensors batch", {},
                                   binary=True),
        "/save_hf": _post("the actor as an HF folder under cluster.fileroot", path | {
            "dtype": {"type": "string", "enum": ["bfloat16", "float16", "float32"]},
            "with_critic": {"type": "boolean"}}, ["path"]),
        "/save_state": _post("exact-resume state, under cluster.fileroot", path, ["path"]),
        "/load_state": _post("load exact-resume state from under cluster.fileroot", path,
                             ["path"]),
        "/weights/gather": _post("gather the weights into buckets", {
            "bucket_bytes": {"type": "integer", "minimum": 1}}, ["bucket_bytes"]),
        "/weights/broadcast": _post("send the gathered buckets", {}),
        "/weights/close": _post("leave the weight-update group", {}),
        "/weights/ipc": _post("the weights in a GPU buffer shared by CUDA IPC (GPU ranks)", {
            "dtype": {"type": "string", "enum": ["bfloat16", "float16", "float32"]}},
            ["dtype"]),
        "/destroy": _post("free the engines and the process group", {}),
    }, api_key=api_key)
