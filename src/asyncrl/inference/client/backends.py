"""The client class of each inference backend."""

from __future__ import annotations

import importlib

from asyncrl.inference.client.base import HTTPInferenceClient

_CLIENTS = {
    "local": ("asyncrl.inference.client.local", "LocalServerClient"),
    "vllm": ("asyncrl.inference.client.vllm", "VLLMClient"),
    "sglang": ("asyncrl.inference.client.sglang", "SGLangClient"),
}


def client_class(backend: str) -> type[HTTPInferenceClient]:
    """The InferenceEngine client that speaks `backend`'s HTTP API."""
    if backend not in _CLIENTS:
        raise ValueError(f"backend {backend!r} is not one of {sorted(_CLIENTS)}")
    module, name = _CLIENTS[backend]
    return getattr(importlib.import_module(module), name)
