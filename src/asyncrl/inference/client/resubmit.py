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

LoRA (a published folder that is PEFT's adapter, from actor.use_lora): the server keeps its
base weights and loads each version as a new adapter by name, `asyncrl-lora-v<N>-<k>` (k
counts the loads, so a name is never reused and no cache of the server keys a prefix
computed under other weights to it); each piece names the adapter of the version it runs
under. The adapter before the newest stays loaded for a piece of the race above; older ones
are unloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.inference.client.base import (
    HTTPInferenceClient,
    InferenceServerError,
    WeightUpdateError,
)

logger = logging.getLogger(__name__)
ADAPTER_PREFIX = "asyncrl-lora"
# PEFT's adapter folder (models/lora.py): what a LoRA trainer publishes
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Step = tuple[str, Callable[[], Awaitable[Any]]]


@dataclass
class Piece:
    """What one generate call returned. `routed_experts` (servers asked to record them):
    int16 [the call's input and output tokens but the last, MoE layers, top_k]."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish: StopReason
    routed_experts: torch.Tensor | None = None


class ResubmittingClient(HTTPInferenceClient):
    """Stitches a generation from pieces, one per weight version it ran under."""

    def __init__(self, addresses: list[str], **kwargs) -> None:
        super().__init__(addresses, **kwargs)
        n = len(self.addresses)
        self._epochs = [0] * n  # weight updates started on each server
        self._idle: list[asyncio.Event] | None = None  # set while no update runs (client loop)
        self._adapters: list[list[str]] = [[] for _ in range(n)]  # LoRA names, newest last
        self._loads = itertools.count(1)

    async def _generate_piece(self, address: str, req: GenerationRequest, done_ids: list[int],
                              adapter: str | None) -> Piece:
        """One generate call for `req` continued after `done_ids`, for the remaining budget,
        under the LoRA adapter named `adapter` (None: the server's weights as they are)."""
        raise NotImplementedError

    def _adapter_steps(self, idx: int, path: str, version: int, name: str,
                       use: Step) -> list[Step]:
        """The steps that load the adapter folder `path` on server `idx` as `name` and label
        it `version`: a pause, the load, `use` (requests name it from then on) and a resume."""
        raise NotImplementedError

    async def _unload_adapter(self, address: str, name: str) -> None:
        """Have the server at `address` forget the adapter `name`."""
        raise NotImplementedError

    async def _generate_on(self, idx: int, req: GenerationRequest) -> GenerationResponse:
        t0 = time.monotonic()
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            await self._idle_event(idx).wait()  # never send into a server mid-update
            epoch, version = self._epochs[idx], self._versions[idx]
            adapter = self._adapters[idx][-1] if self._adapters[idx] else None
            piece = await self._generate_piece(self.addresses[idx], req, ids, adapter)
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
                                  stop_reason=finish, latency_s=time.monotonic() - t0,
                                  routed_experts=_with_last_row(piece.routed_experts))

    async def _update_server(self, idx: int, path: str, version: int) -> None:
        """Hold new pieces back on this server while it updates."""
        event = self._idle_event(idx)
        event.clear()
        self._epochs[idx] += 1
        try:
            await super()._update_server(idx, path, version)
        finally:
            event.set()

    async def _update_adapter(self, idx: int, path: str, version: int) -> None:
        """Load the adapter folder `path` as a new name and serve it as `version`; then
        unload the adapters before the one it replaces (best effort)."""
        name = f"{ADAPTER_PREFIX}-v{version}-{next(self._loads)}"
        loaded = self._adapters[idx]

        async def use() -> None:
            loaded.append(name)

        await self._update_steps(idx, version,
                                 self._adapter_steps(idx, path, version, name, ("use", use)))
        stale, loaded[:] = loaded[:-2], loaded[-2:]
        for old in stale:
            try:
                await self._unload_adapter(self.addresses[idx], old)
            except InferenceServerError as e:  # a restarted server no longer has it
                logger.warning("could not unload LoRA adapter %s: %s", old, e)

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
        needed = ([ADAPTER_WEIGHTS] if is_adapter_folder(path)
                  else ["config.json", "*.safetensors"])
        missing = [name for name in needed if not any(folder.glob(name))]
        if missing:
            raise WeightUpdateError(f"weight update to version {version}: checkpoint {path!r} "
                                    f"has no {' or '.join(missing)}")


def is_adapter_folder(path: str) -> bool:
    """True where `path` holds a LoRA adapter (PEFT's config file), not full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _with_last_row(routes: torch.Tensor | None) -> torch.Tensor | None:
    """The last piece's routed experts, which cover every token the server ran (its prefill
    routed the earlier pieces' tokens again under its weights), plus a row of -1 for the
    last token, sampled but never run (GenerationResponse's convention)."""
    if routes is None:
        return None
    return torch.cat([routes, torch.full_like(routes[:1], -1)])
