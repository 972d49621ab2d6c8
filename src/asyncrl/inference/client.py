"""HTTP client for our own `local` inference servers (the `InferenceEngine` protocol).

The server does the hard part: a weight update interrupts decoding in place and every token
comes back tagged with its version, so a generation is one /generate call.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.inference.base import (
    HTTPInferenceEngine,
    InferenceServerError,
    ServerUnreachableError,
    WeightUpdateError,
)

__all__ = ["InferenceServerError", "RemoteInferenceEngine", "ServerUnreachableError",
           "WeightUpdateError"]


class RemoteInferenceEngine(HTTPInferenceEngine):
    """Routes generations to the least-busy local server and syncs weights on all of them."""

    backend = "local"

    async def _generate_on(self, idx: int, req: GenerationRequest) -> GenerationResponse:
        body = await self._request(self.addresses[idx], "/generate", req.to_dict(),
                                   timeout=self.request_timeout)
        return GenerationResponse.from_dict(body)

    async def _update_one(self, idx: int, path: str, version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        await self._update_steps(idx, version, [
            ("pause", lambda: self._request(address, "/pause", None, timeout=t)),
            ("update_weights", lambda: self._request(
                address, "/update_weights", {"path": path, "version": version}, timeout=t)),
            ("resume", lambda: self._request(address, "/resume", None, timeout=t)),
        ])

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
