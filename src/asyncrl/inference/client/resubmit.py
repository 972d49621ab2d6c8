"""Generation across weight updates on servers whose pause aborts requests (vLLM, SGLang).

AReaL's approach: a weight update pauses the server, which aborts every request in flight
and returns the tokens sampled so far. The client then resubmits prompt + tokens-so-far for
the remaining budget to the same server (rid affinity), once the update is done, and
stitches the pieces. Each piece was sampled under one weight version: a pause aborts all
that is in flight, and a piece is only sent while no update runs on its server.

One race is left: a piece sent just before an update starts may reach the server after
its pause, wait there, and run whole under the new weights while tagged with the old
version. Its log-probs are still right (they come from the server); only the staleness
count of those tokens is one version high.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.inference.client.base import HTTPInferenceEngine, WeightUpdateError


@dataclass
class Piece:
    """What one generate call returned."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish: StopReason


class ResubmittingEngine(HTTPInferenceEngine):
    """Stitches a generation from pieces, one per weight version it ran under."""

    def __init__(self, addresses: list[str], **kwargs) -> None:
        super().__init__(addresses, **kwargs)
        n = len(self.addresses)
        self._epochs = [0] * n  # weight updates started on each server
        self._idle: list[asyncio.Event] | None = None  # set while no update runs (client loop)

    async def _generate_piece(self, address: str, req: GenerationRequest,
                              done_ids: list[int]) -> Piece:
        """One generate call for `req` continued after `done_ids`, for the remaining budget."""
        raise NotImplementedError

    async def _generate_on(self, idx: int, req: GenerationRequest) -> GenerationResponse:
        t0 = time.monotonic()
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self._idle_event(idx).wait()  # never send into a server mid-update
            epoch, version = self._epochs[idx], self._versions[idx]
            piece = await self._generate_piece(self.addresses[idx], req, ids)
            ids += piece.output_ids
            logprobs += piece.output_logprobs
            versions += [version] * len(piece.output_ids)
            finish = piece.finish
            interrupted = finish == StopReason.ABORT and self._epochs[idx] != epoch
            if not interrupted:
                break  # done, or aborted by someone else: report it as such
            if len(ids) >= req.sampling.max_new_tokens:
                finish = StopReason.LENGTH
                break
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=logprobs, output_versions=versions,
                                  stop_reason=finish, latency_s=time.monotonic() - t0)

    async def _update_server(self, idx: int, path: str, version: int) -> None:
        """Hold new pieces back on this server while it updates."""
        event = self._idle_event(idx)
        event.clear()
        self._epochs[idx] += 1
        try:
            await super()._update_server(idx, path, version)
        finally:
            event.set()

    def _idle_event(self, idx: int) -> asyncio.Event:
        if self._idle is None:
            self._idle = [asyncio.Event() for _ in self.addresses]
            for e in self._idle:
                e.set()
        return self._idle[idx]

    def _check_checkpoint(self, path: str, version: int) -> None:
        """The servers load HF folders by path: a missing one would be looked up on a model hub."""
        folder = Path(path)
        if not os.path.isabs(path) or not folder.is_dir():
            raise WeightUpdateError(f"weight update to version {version}: checkpoint {path!r} is "
                                    "not an existing folder (an absolute path is needed)")
        missing = [name for name, ok in (
            ("config.json", (folder / "config.json").is_file()),
            ("*.safetensors", any(folder.glob("*.safetensors")))) if not ok]
        if missing:
            raise WeightUpdateError(f"weight update to version {version}: checkpoint {path!r} "
                                    f"has no {' or '.join(missing)}")
