"""The command line and environment that start one inference server of each backend.

One function so that the scheduler and `asyncrl serve` start servers the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

BACKENDS = ("local", "vllm", "sglang")


def server_command(backend: str, model_path: str, host: str, port: int, *,
                   dtype: str = "bfloat16", device: str = "cpu",
                   extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start a `backend` server for `model_path` on host:port.

    `device` is "cpu", "cuda" (every visible GPU) or "cuda:<ids>" (e.g. "cuda:2" or
    "cuda:0,1", which sets CUDA_VISIBLE_DEVICES). `extra` is appended to argv as given.
    The environment is the current one plus what the backend needs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {list(BACKENDS)}")
    if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device {device!r} is not 'cpu', 'cuda' or 'cuda:<ids>'")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1")  # a bad path must fail, never turn into a hub download
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    address = ["--host", host, "--port", str(port)]
    if backend == "local":
        argv = [sys.executable, "-m", "asyncrl.inference.server", "--model", model_path,
                *address, "--dtype", dtype]
    elif backend == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                *address, "--dtype", dtype,
                # log_softmax(logits / T) of the sampled token: what the trainer recomputes
                "--logprobs-mode", "processed_logprobs",
                # reload_weights that keeps tied embeddings tied (see vllm_worker.py)
                "--worker-extension-cls", "asyncrl.inference.vllm_worker.WeightSyncExtension"]
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables /collective_rpc (reload_weights)
        env.setdefault("VLLM_HOST_IP", host)  # its engine processes talk over this address
        env["VLLM_NO_USAGE_STATS"] = "1"  # vLLM otherwise posts usage data to its stats server
        env["DO_NOT_TRACK"] = "1"
        if device == "cpu":
            # Eager mode starts fast; the KV cache is given in GB on CPU (default: 4).
            argv += ["--enforce-eager", "--gpu-memory-utilization", "0.3"]
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                *address, "--dtype", dtype]
        if device == "cpu":
            argv += ["--device", "cpu"]
    return argv + list(extra), env
