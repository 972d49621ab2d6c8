"""The `local` inference engine, its HTTP server, and the HTTP client the rollout side uses.

model.py (decoder forward + slot KV cache), sampling.py, engine.py (continuous batching,
interruptible weight updates), server.py (aiohttp), client.py (RemoteInferenceEngine).
Clients of other servers share base.py: vllm.py, sglang.py (resubmit.py stitches a
generation across the aborts of a weight update). Server command lines live in
`asyncrl.scheduler.commands`.
Names are imported lazily so that importing the client does not load transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RemoteInferenceEngine": "client", "InferenceServerError": "client",
    "WeightUpdateError": "client", "LocalEngine": "engine", "Transformer": "model",
    "CheckpointError": "model", "serve": "server", "main": "server",
    "VLLMInferenceEngine": "vllm", "SGLangInferenceEngine": "sglang",
    "client_class": "backends",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
