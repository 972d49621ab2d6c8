"""Clients of inference servers: what the rollout side and the gateway talk to.

client.py (`RemoteInferenceEngine`, for our own `local` server in `asyncrl.engine`),
vllm.py and sglang.py, all over base.py's shared HTTP plumbing; resubmit.py stitches a
generation across the aborts of a weight update; backends.py picks a client by backend
name. The server side of vllm.py's weight reload runs inside vLLM's workers, so it lives
with the engines (`asyncrl.engine.vllm_worker`). Server command lines live in
`asyncrl.scheduler.commands`.
Names are imported lazily so that importing one client does not load the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RemoteInferenceEngine": "client", "InferenceServerError": "client",
    "WeightUpdateError": "client", "VLLMInferenceEngine": "vllm",
    "SGLangInferenceEngine": "sglang", "client_class": "backends",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
