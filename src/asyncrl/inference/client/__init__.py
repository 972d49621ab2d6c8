"""Clients of inference servers: what the rollout side and the gateway talk to.

local.py (`LocalServerClient`, for our own `local` server in
`asyncrl.inference.server`), vllm.py and sglang.py, all over base.py's shared HTTP
plumbing; resubmit.py stitches a generation across the aborts of a weight update;
backends.py picks a client by backend name. vllm_worker.py is the server side of vllm.py's
weight reload: it runs inside vLLM's workers, loaded by name with --worker-extension-cls.
Server command lines live in `asyncrl.launch.commands`.
Names are imported lazily so that importing one client does not load the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LocalServerClient": "local", "InferenceServerError": "local",
    "WeightUpdateError": "local", "VLLMClient": "vllm",
    "SGLangClient": "sglang", "client_class": "backends",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
