"""HTTP client for our own `local` inference servers (the `InferenceEngine` protocol).

The server does the hard part: a weight update interrupts decoding in place and every token
comes back tagged with its version, so a generation is one /generate call. A broadcast
update is one /update_weights_from_distributed call that receives every bucket and swaps
the weights in, with their version, only once all have come; a CUDA IPC update is one
/update_weights_from_ipc call that copies the trainer's shared buffer the same way.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.inference.client.base import (
    HTTPInferenceClient,
    InferenceServerError,
    ServerUnreachableError,
    WeightBroadcast,
    WeightIpc,
    WeightUpdateError,
)

__all__ = ["InferenceServerError", "LocalServerClient", "ServerUnreachableError",
           "WeightUpdateError"]


class LocalServerClient(HTTPInferenceClient):
    """Routes generations to the least-busy local server and syncs weights on all of them."""

    backend = "local"
    serves_images = True  # GenerationRequest.to_dict carries them to /generate

    async def _generate_on(self, idx: int, req: GenerationRequest) -> GenerationResponse:
        body = await self._request(self.addresses[idx], "/generate", req.to_dict(),
                                   timeout=self.request_timeout)
        return GenerationResponse.from_dict(body)

    async def _update_one(self, idx: int, path: str | WeightBroadcast | WeightIpc,
                          version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        if isinstance(path, WeightIpc):
            body = {**path.body, "weight_version": str(version)}
            load = ("update_weights_from_ipc", lambda: self._request(
                address, "/update_weights_from_ipc", body, timeout=t))
        elif isinstance(path, WeightBroadcast):
            body = {**path.layout, "group_name": path.group_name, "weight_version": str(version)}
            load = ("update_weights_from_distributed", lambda: self._request(
                address, "/update_weights_from_distributed", body, timeout=t))
        else:
            load = ("update_weights", lambda: self._request(
                address, "/update_weights", {"path": path, "version": version}, timeout=t))
        await self._update_steps(idx, version, [
            ("pause", lambda: self._request(address, "/pause", None, timeout=t)),
            load,
            ("resume", lambda: self._request(address, "/resume", None, timeout=t)),
        ])

    def _join_request(self, rank: int, world_size: int, master_address: str, master_port: int,
                      group_name: str, backend: str, bucket_bytes: int) -> tuple[str, dict]:
        return "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank,
            "world_size": world_size, "group_name": group_name, "backend": backend,
            "timeout": self.update_weights_timeout}

    def _leave_request(self, group_name: str) -> tuple[str, dict | None]:
        return "/destroy_weights_update_group", {"group_name": group_name}

    async def _read_version(self, address: str) -> int:
        body = await self._request(address, "/version", None, timeout=self.update_weights_timeout,
                                   method="GET")
        return int(body["version"])

    async def _pause_one(self, address: str) -> Any:
        return await self._request(address, "/pause", None, timeout=self.update_weights_timeout)

    async def _resume_one(self, address: str) -> Any:
        return await self._request(address, "/resume", None, timeout=self.update_weights_timeout)

    async def health(self) -> list[dict[str, Any]]:
        """/health of every live server, in address order."""
        return await self._on_live(lambda a: self._request(
            a, "/health", None, timeout=self.update_weights_timeout, method="GET"))
