"""The client class of each inference backend."""

from __future__ import annotations

import importlib

from asyncrl.inference.client.base import HTTPInferenceEngine

_CLIENTS = {
    "local": ("asyncrl.inference.client.local", "RemoteInferenceEngine"),
    "vllm": ("asyncrl.inference.client.vllm", "VLLMInferenceEngine"),
    "sglang": ("asyncrl.inference.client.sglang", "SGLangInferenceEngine"),
}


def client_class(backend: str) -> type[HTTPInferenceEngine]:
    """The InferenceEngine client that speaks `backend`'s HTTP API."""
    if backend not in _CLIENTS:
        raise ValueError(f"backend {backend!r} is not one of {sorted(_CLIENTS)}")
    module, name = _CLIENTS[backend]
    return getattr(importlib.import_module(module), name)
