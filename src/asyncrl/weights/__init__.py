"""Weight publication and sync to inference servers: by disk, broadcast or CUDA IPC."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from asyncrl.weights.broadcast import BroadcastError, BroadcastPublisher, WeightSender
from asyncrl.weights.ipc import IpcPublisher
from asyncrl.weights.publisher import PublishError, WeightPublisher

__all__ = ["BroadcastError", "BroadcastPublisher", "IpcPublisher", "PublishError",
           "WeightPublisher", "WeightSender", "make_publisher", "transfer_backend"]
MODES = ("disk", "broadcast", "ipc")


def transfer_backend(inference_backend: str, cuda: bool | None = None) -> str:
    """The group a broadcast to these servers needs: "gloo" (ours; SGLang on CPU), "nccl"
    (SGLang on GPU) or "vllm" (vLLM's NCCL weight transfer, GPU only)."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    return {"local": "gloo", "sglang": "nccl" if cuda else "gloo", "vllm": "vllm"}[
        inference_backend]


def make_publisher(mode: str, engine: Any, *, root: Path, dtype: str = "bfloat16",
                   bucket_mb: int = 256, timeout: float = 300.0,
                   master_address: str = "127.0.0.1", sender: Any = None,
                   run: Callable[[Coroutine], Any] = asyncio.run
                   ) -> WeightPublisher | BroadcastPublisher | IpcPublisher:
    """The publisher of `actor.weight_update_mode`: versioned folders under `root`, a
    broadcast from trainer rank 0 in buckets of `bucket_mb` MiB (this process's, or the
    training service's through `sender`: trainer.service.RemoteWeightSender), or the
    trainer's GPU buffer shared by CUDA IPC."""
    if mode == "disk":
        return WeightPublisher(root, engine, dtype=dtype, run=run)
    if mode == "ipc":
        return IpcPublisher(engine, dtype=dtype, run=run)
    if mode == "broadcast":
        return BroadcastPublisher(engine, sender, dtype=dtype, bucket_mb=bucket_mb,
                                  timeout=timeout, backend=transfer_backend(engine.backend),
                                  master_address=master_address, run=run)
    raise ValueError(f"actor.weight_update_mode must be one of {MODES}, got {mode!r}")
