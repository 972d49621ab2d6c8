"""`LocalEngine` seen from asyncio: `agenerate`, and `astream` that yields tokens as made.

The engine thread hands results over with `call_soon_threadsafe`, so handlers on the
event loop never run model code and never block on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.openai.routes import StreamedToken


def _settle(fut: asyncio.Future, result: Any) -> None:
    if fut.done():  # the waiting handler went away
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


class LocalBackend:
    """Async generation on a started `LocalEngine` (the OpenAI routes' engine)."""

    # The OpenAI routes serve top-k log-probs and prompt log-probs (echo) from this engine.
    serves_top_logprobs = True
    serves_images = True  # a vision-language model's requests carry their images

    def __init__(self, engine: LocalEngine):
        self.engine = engine

    async def ascore(self, input_ids: list[int], top_k: int = 0
                     ) -> tuple[list[float | None], list[dict[int, float] | None]]:
        """`LocalEngine.score` off the event loop (ValueError if the engine refuses the ids)."""
        return await asyncio.to_thread(self.engine.score, input_ids, top_k)

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        """Generate one completion; ValueError if the engine refuses the request."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.engine.submit(req, lambda r: loop.call_soon_threadsafe(_settle, fut, r))
        return await fut

    def astream(self, req: GenerationRequest) -> AsyncIterator[StreamedToken | GenerationResponse]:
        """Submit now (ValueError if refused); iterate for each token, then the response."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.engine.submit(
            req, on_done=lambda r: loop.call_soon_threadsafe(queue.put_nowait, r),
            on_token=lambda t, lp, v: loop.call_soon_threadsafe(
                queue.put_nowait, StreamedToken(t, lp, v)))
        return _drain(queue)


async def _drain(queue: asyncio.Queue) -> AsyncIterator[StreamedToken | GenerationResponse]:
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if isinstance(item, GenerationResponse):
            return
