"""HTTP client for one or more local inference servers (the `InferenceEngine` protocol).

All HTTP runs on one private event loop in a daemon thread, with one aiohttp session.
Public coroutines hand their work to that loop and await the result, so the client works
from any event loop in any thread (the rollout thread's loop, the trainer's
`asyncio.run(...)`), and no session is ever bound to a loop that has since closed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

from asyncrl.api.errors import InferenceError
from asyncrl.api.types import GenerationRequest, GenerationResponse

T = TypeVar("T")
_RETRY_BACKOFF_S = 0.25  # doubled after each failed connection attempt
_MAX_PINNED_RIDS = 100_000  # rid -> server memory, oldest forgotten first


class InferenceServerError(InferenceError):
    """A server could not be reached, timed out, or answered with an error."""


class WeightUpdateError(InferenceServerError):
    """A weight update failed on a server; the message names the server, step and cause."""


def _normalise(address: str) -> str:
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


class RemoteInferenceEngine:
    """Routes generations to the least-busy server and syncs weights on all of them."""

    def __init__(self, addresses: list[str], *, request_timeout: float = 3600.0,
                 request_retries: int = 3, update_weights_timeout: float = 300.0,
                 api_key: str | None = None):
        if not addresses:
            raise ValueError("RemoteInferenceEngine needs at least one server address")
        self.addresses = [_normalise(a) for a in addresses]
        self.request_timeout = request_timeout
        self.request_retries = request_retries
        self.update_weights_timeout = update_weights_timeout
        api_key = api_key if api_key is not None else os.environ.get("ASYNCRL_API_KEY")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._outstanding = [0] * len(self.addresses)
        self._next = 0  # round-robin tie-break among equally busy servers
        self._pinned: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None

    # ---- the InferenceEngine protocol ---------------------------------------------------

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        """Generate on the least-busy server (the server that served `req.rid` before, if any)."""
        idx = self._acquire(req.rid)
        try:
            body = await self._on_client_loop(self._request(
                self.addresses[idx], "/generate", req.to_dict(), timeout=self.request_timeout))
        finally:
            with self._lock:
                self._outstanding[idx] -= 1
        return GenerationResponse.from_dict(body)

    async def pause(self) -> None:
        """Pause decoding on every server."""
        await self._on_all("/pause")

    async def resume(self) -> None:
        """Resume decoding on every server."""
        await self._on_all("/resume")

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """On every server at once: pause, load `path` as `version`, resume.

        Each step is bounded by `update_weights_timeout`. On failure the server is resumed
        (best effort) and WeightUpdateError names the server, the step and the cause.
        """
        results = await self._on_client_loop(self._gather(
            [self._update_one(a, path, version) for a in self.addresses]))
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise WeightUpdateError("; ".join(str(e) for e in errors))

    async def close(self) -> None:
        """Close the HTTP session and stop the client's loop thread."""
        if self._loop is None:
            return
        if self._session is not None:
            await self._on_client_loop(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = self._thread = self._session = None

    # ---- health ---------------------------------------------------------------------------

    async def health(self) -> list[dict[str, Any]]:
        """/health of every server, in address order."""
        return await self._on_all("/health", method="GET")

    async def get_version(self) -> int:
        """The lowest weight version across servers (all equal outside an update)."""
        return min(v["version"] for v in await self._on_all("/version", method="GET"))

    async def wait_healthy(self, timeout: float) -> None:
        """Poll /health until every server answers ok; InferenceServerError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            results = await self._on_client_loop(self._gather([
                self._request(a, "/health", None, timeout=5.0, method="GET", retries=0)
                for a in self.addresses]))
            failed = {a: r for a, r in zip(self.addresses, results)
                      if isinstance(r, BaseException) or r.get("status") != "ok"}
            if not failed:
                return
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{a}: {r}" for a, r in failed.items())
                raise InferenceServerError(
                    f"inference servers not healthy after {timeout}s: {detail}")
            await asyncio.sleep(0.5)

    # ---- internals ------------------------------------------------------------------------

    def _acquire(self, rid: str) -> int:
        with self._lock:
            idx = self._pinned.get(rid)
            if idx is None:
                n = len(self.addresses)
                order = [(self._next + k) % n for k in range(n)]
                idx = min(order, key=lambda i: self._outstanding[i])
                self._next = (idx + 1) % n
                self._pinned[rid] = idx
                if len(self._pinned) > _MAX_PINNED_RIDS:
                    self._pinned.popitem(last=False)
            self._outstanding[idx] += 1
            return idx

    async def _on_client_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and await it from the caller's loop."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="asyncrl-inference-client", daemon=True)
                self._thread.start()
            loop = self._loop
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def _on_all(self, path: str, method: str = "POST") -> list[Any]:
        results = await self._on_client_loop(self._gather([
            self._request(a, path, None, timeout=self.update_weights_timeout, method=method)
            for a in self.addresses]))
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    @staticmethod
    async def _gather(coros: list[Coroutine]) -> list[Any]:
        return await asyncio.gather(*coros, return_exceptions=True)

    async def _update_one(self, address: str, path: str, version: int) -> None:
        t = self.update_weights_timeout
        step = "pause"
        try:
            await self._request(address, "/pause", None, timeout=t)
            step = "update_weights"
            await self._request(address, "/update_weights", {"path": path, "version": version},
                                timeout=t)
            step = "resume"
            await self._request(address, "/resume", None, timeout=t)
        except InferenceServerError as e:
            if step != "resume":
                try:  # leave the server generating (under its old weights) if we can
                    await self._request(address, "/resume", None, timeout=t, retries=0)
                except InferenceServerError:
                    pass
            raise WeightUpdateError(f"weight update to version {version} failed on {address} "
                                    f"at step {step!r}: {e}") from e

    async def _request(self, address: str, path: str, payload: Any, *, timeout: float,
                       method: str = "POST", retries: int | None = None) -> Any:
        """One HTTP call on the client loop; retried (with backoff) only if nobody answers."""
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        retries = self.request_retries if retries is None else retries
        url = address + path
        for attempt in range(retries + 1):
            try:
                async with self._session.request(method, url, json=payload,
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise InferenceServerError(
                            f"{url} answered {r.status}: {_error_message(text)}")
                    return json.loads(text)
            except aiohttp.ClientConnectorError as e:
                if attempt == retries:
                    raise InferenceServerError(f"inference server {address} cannot be reached "
                                               f"({retries + 1} attempts): {e}") from e
                await asyncio.sleep(_RETRY_BACKOFF_S * 2 ** attempt)
            except asyncio.TimeoutError as e:
                raise InferenceServerError(f"{url} did not answer within {timeout}s") from e
            except aiohttp.ClientError as e:
                raise InferenceServerError(f"{url} failed: {type(e).__name__}: {e}") from e
        raise AssertionError("unreachable")


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
