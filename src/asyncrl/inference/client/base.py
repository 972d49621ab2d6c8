"""What every backend's HTTP client shares: the loop thread, HTTP, routing and weight sync.

All HTTP runs on one private event loop in a daemon thread, with one aiohttp session.
Public coroutines hand their work to that loop and await the result, so a client works
from any event loop in any thread (the rollout thread's loop, the trainer's
`asyncio.run(...)`), and no session is ever bound to a loop that has since closed.

Routing: a request goes to the least-busy live server, and a request id (or the request's
affinity key: an agent session's) keeps its server, so a resubmitted request or the next
turn of a session finds its prefix in that server's cache.

Re-sync: the client remembers the last (path, version) it loaded. A server that cannot be
reached is taken out of routing; `check_servers` (on demand, or every
`health_check_interval` seconds) puts it back only once it answers its health check and
holds that version, loading it first if the server came back with other weights.

Weight sync by broadcast (weights/broadcast.py drives it): `init_weights_update_group`
has the servers join the trainer's process group (server k is rank 1 + k; the trainer,
rank 0, joins at the same time), and `update_weights_from_distributed` pauses every
member, has it receive the trainer's buckets and serve them as version N, and resumes it,
while the trainer broadcasts. A server that comes back after a broadcast holds no file to
re-sync from: it stays out of routing and joins the group made for the next broadcast.

Weight sync by CUDA IPC (weights/ipc.py; a trainer on the servers' GPU):
`update_weights_from_ipc` pauses every server it can reach, has it copy the trainer's shared
buffer and serve it as version N, and resumes it. As after a broadcast, a server that comes
back in between waits out of routing for the next update, which takes it back.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from asyncrl.api.errors import InferenceError
from asyncrl.api.types import GenerationRequest, GenerationResponse

logger = logging.getLogger(__name__)
T = TypeVar("T")
_RETRY_BACKOFF_S = 0.25  # doubled after each failed connection attempt
_MAX_PINNED_RIDS = 100_000  # rid -> server memory, oldest forgotten first
_PROBE_TIMEOUT_S = 5.0
GROUP_NAME = "weight_update_group"  # SGLang's default name of the weight-update group


class InferenceServerError(InferenceError):
    """A server could not be reached, timed out, or answered with an error."""


class ServerUnreachableError(InferenceServerError):
    """Nobody answered at a server's address (refused, reset or disconnected)."""


class ServerStatusError(InferenceServerError):
    """A server answered with an HTTP error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class WeightUpdateError(InferenceServerError):
    """A weight update failed on a server; the message names the server, step and cause."""


@dataclass(frozen=True)
class WeightBroadcast:
    """A weight update that comes by the trainer's broadcast, not from a folder.

    `layout`: names, dtypes, shapes, byte offsets and tensors per bucket, as the fields of
    SGLang's /update_weights_from_distributed body (weights/transport.py `BucketLayout`).
    """

    layout: dict[str, Any]
    group_name: str = GROUP_NAME


@dataclass(frozen=True)
class WeightIpc:
    """A weight update that a server copies from the trainer's GPU memory (CUDA IPC).

    `body`: the layout fields of SGLang's /update_weights_from_distributed body (one
    bucket) and `ipc_handle`, the shared buffer (weights/ipc.py `IpcExporter.export`).
    """

    body: dict[str, Any]


def normalise_address(address: str) -> str:
    """`host:port` or a URL, as a URL without a trailing slash."""
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


class HTTPInferenceClient:
    """Base of the backend clients; subclasses say how to generate and load weights."""

    backend = "base"
    health_path = "/health"
    serves_images = False  # whether requests' images reach the servers (local, vllm)

    def __init__(self, addresses: list[str], *, request_timeout: float = 3600.0,
                 request_retries: int = 3, update_weights_timeout: float = 300.0,
                 api_key: str | None = None, health_check_interval: float | None = None,
                 server_wait_timeout: float = 0.0):
        if not addresses:
            raise ValueError(f"{type(self).__name__} needs at least one server address")
        self.addresses = [normalise_address(a) for a in addresses]
        self.request_timeout = request_timeout
        self.request_retries = request_retries
        self.update_weights_timeout = update_weights_timeout
        self.health_check_interval = health_check_interval
        # Seconds a request waits for a live server when none is (0: fail at once).
        self.server_wait_timeout = server_wait_timeout
        api_key = api_key if api_key is not None else os.environ.get("ASYNCRL_API_KEY")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        n = len(self.addresses)
        self._lock = threading.Lock()
        self._outstanding = [0] * n
        self._next = 0  # round-robin tie-break among equally busy servers
        self._pinned: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._down: dict[int, str] = {}  # server index -> why it left routing
        self._versions = [0] * n  # the weight version each server holds (0: the base model)
        self._synced: tuple[str, int] | None = None  # the last (path, version) loaded
        self._broadcast_version: int | None = None  # the last version broadcast, if newer
        self._group: list[int] = []  # servers in the weight-update group, in rank order
        self._group_name: str | None = None
        self._join_failed: set[int] = set()  # returning servers left out of the next group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._update_lock: asyncio.Lock | None = None  # made on the client loop
        self._health_task: asyncio.Task | None = None
        # observe/timeline.py's Timeline (duck-typed: begin/end), set by the run that owns
        # the client: each server's "generate" spans (requests in flight) and weight loads.
        self.timeline: Any = None

    # ---- what a backend provides ----------------------------------------------------------

    async def _generate_on(self, idx: int, req: GenerationRequest) -> GenerationResponse:
        """Generate `req` on server `idx` (runs on the client loop)."""
        raise NotImplementedError

    async def _update_one(self, idx: int, path: str | WeightBroadcast | WeightIpc,
                          version: int) -> None:
        """Pause, load `path` (or receive a broadcast, or copy the trainer's shared buffer)
        as `version`, resume on server `idx`; WeightUpdateError if not."""
        raise NotImplementedError

    def _join_request(self, rank: int, world_size: int, master_address: str, master_port: int,
                      group_name: str, backend: str, bucket_bytes: int) -> tuple[str, dict]:
        """The (path, body) that has a server join the weight-update group as `rank`."""
        raise NotImplementedError

    def _leave_request(self, group_name: str) -> tuple[str, dict | None]:
        """The (path, body) that has a server leave the weight-update group."""
        raise NotImplementedError

    async def _read_version(self, address: str) -> int:
        """The weight version a server reports holding."""
        raise NotImplementedError

    async def _pause_one(self, address: str) -> None:
        raise NotImplementedError

    async def _resume_one(self, address: str) -> None:
        raise NotImplementedError

    def _check_checkpoint(self, path: str, version: int) -> None:
        """Reject a bad weights folder before any server is paused (default: the server does)."""

    # ---- the InferenceEngine protocol ---------------------------------------------------

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        """Generate on the least-busy live server (the one that served `req.rid` before, if any)."""
        if req.images is not None and not self.serves_images:
            raise ValueError(f"request {req.rid} has images, but the {self.backend} backend's "
                             "client sends its servers none; serve a vision-language model "
                             "with our engine (rollout.backend local)")
        return await self._on_client_loop(self._route(req))

    async def pause(self) -> None:
        """Pause decoding on every live server."""
        await self._on_live(self._pause_one)

    async def resume(self) -> None:
        """Resume decoding on every live server."""
        await self._on_live(self._resume_one)

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """On every live server at once: pause, load `path` as `version`, resume.

        Each step is bounded by `update_weights_timeout`. On failure the server is resumed
        (best effort) and WeightUpdateError names the server, the step and the cause; a
        server that cannot be reached also leaves routing until `check_servers` re-syncs it.
        """
        self._check_checkpoint(path, version)
        await self._on_client_loop(self._update_all(path, version))

    async def reachable_servers(self) -> list[str]:
        """The servers a new weight-update group should hold: every live one, and every one
        out of routing that answers its health check now (the next broadcast re-syncs it)."""
        return await self._on_client_loop(self._reachable())

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        servers: list[str], bucket_bytes: int,
                                        backend: str = "gloo",
                                        group_name: str = GROUP_NAME) -> None:
        """Have `servers` join the trainer's weight-update group, server k as rank 1 + k of
        1 + len(servers); the trainer must host it as rank 0 meanwhile.

        Each join waits for all ranks, up to `update_weights_timeout`. `bucket_bytes` is the
        trainer's bucket size (vLLM reads it here). WeightUpdateError names the servers
        that failed.
        """
        idx = [self.addresses.index(normalise_address(a)) for a in servers]
        await self._on_client_loop(self._init_group(
            idx, master_address, master_port, group_name, backend, bucket_bytes))

    async def update_weights_from_distributed(self, layout: dict[str, Any], version: int, *,
                                              group_name: str = GROUP_NAME) -> None:
        """On every group member at once: pause, receive the trainer's broadcast of `layout`
        (the layout fields of SGLang's /update_weights_from_distributed body), serve it as
        `version`, resume; the trainer broadcasts meanwhile.

        Each step is bounded by `update_weights_timeout`. A failed update leaves a server
        with its old weights and version (ours; see each backend) and resumed, drops the
        group (make a new one before the next broadcast), and raises WeightUpdateError
        naming the servers, steps and causes.
        """
        broadcast = WeightBroadcast(layout, group_name)
        await self._on_client_loop(self._update_all_broadcast(broadcast, version))

    async def update_weights_from_ipc(self, body: dict[str, Any], version: int) -> None:
        """On every server that answers (those out of routing too): pause, copy the weights
        the trainer shares by CUDA IPC (`body`: weights/ipc.py's update body) and serve them
        as `version`, resume; the servers updated are in routing afterwards.

        Each step is bounded by `update_weights_timeout`; the trainer must not write its
        buffer before this returns. A failed update leaves our server with its old weights
        and version (vLLM's: see its client), and WeightUpdateError names the servers, steps
        and causes.
        """
        await self._on_client_loop(self._update_all_ipc(WeightIpc(body), version))

    async def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> None:
        """Best effort: have every member leave the group (a dead one is not waited for)."""
        await self._on_client_loop(self._leave_group(group_name))

    @property
    def weight_group(self) -> list[str]:
        """Addresses of the weight-update group's servers in rank order (empty: no group)."""
        return [self.addresses[i] for i in self._group]

    @property
    def weight_group_name(self) -> str | None:
        """The name of the weight-update group the servers are in (None: none)."""
        return self._group_name if self._group else None

    async def close(self) -> None:
        """Close the HTTP session and stop the client's loop thread."""
        if self._loop is None:
            return
        await self._on_client_loop(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = self._thread = self._session = None

    # ---- health and re-sync ---------------------------------------------------------------

    @property
    def live_servers(self) -> list[str]:
        """Addresses currently in routing."""
        return [a for i, a in enumerate(self.addresses) if i not in self._down]

    @property
    def down_servers(self) -> dict[str, str]:
        """Addresses out of routing, and why."""
        return {self.addresses[i]: why for i, why in sorted(self._down.items())}

    async def get_version(self) -> int:
        """The lowest weight version across live servers (all equal outside an update)."""
        return min(await self._on_live(self._read_version))

    async def check_servers(self) -> list[str]:
        """Probe every server: drop the dead, re-sync and restore the returned; live addresses."""
        await self._on_client_loop(self._check_servers())
        return self.live_servers

    def replace_server(self, idx: int, address: str) -> None:
        """Server `idx` now lives at `address` (restarted elsewhere): out of routing until
        `check_servers` finds it healthy and re-synced."""
        with self._lock:
            self.addresses[idx] = normalise_address(address)
            self._down[idx] = "restarted at a new address"

    async def wait_healthy(self, timeout: float) -> None:
        """Poll every server's health until all answer; InferenceServerError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            results = await self._on_client_loop(self._gather(
                [self._probe(a) for a in self.addresses]))
            failed = {a: r for a, r in zip(self.addresses, results) if r is not True}
            if not failed:
                return
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{a}: {r}" for a, r in failed.items())
                raise InferenceServerError(
                    f"inference servers not healthy after {timeout}s: {detail}")
            await asyncio.sleep(0.5)

    # ---- internals (client loop) ----------------------------------------------------------

    async def _route(self, req: GenerationRequest) -> GenerationResponse:
        self._start_health_task()
        while True:
            key = req.affinity or req.rid
            idx = await self._acquire_or_wait(key)
            try:
                return await self._generate_on(idx, req)
            except ServerUnreachableError as e:
                self._mark_down(idx, str(e))
                with self._lock:
                    self._pinned.pop(key, None)  # start again on another server, or this
                    # one once it is back (restarted by the run's scheduler)
            except ServerStatusError as e:
                # A server error from a server that then fails its health check is a dying
                # server (vLLM answers 500 to every request in flight when its engine dies):
                # the request runs again elsewhere, or here once the server is restarted.
                if e.status < 500 or await self._probe(self.addresses[idx]) is True:
                    raise
                self._mark_down(idx, str(e))
                with self._lock:
                    self._pinned.pop(key, None)
            finally:
                with self._lock:
                    self._outstanding[idx] -= 1
                    if self.timeline is not None and not self._outstanding[idx]:
                        self.timeline.end(f"server {idx}", "generate")

    async def _acquire_or_wait(self, key: str) -> int:
        """A live server for `key`; with none live, wait up to `server_wait_timeout` for one
        to come back (a scheduler restarting it), checking every half second."""
        idx = self._acquire(key)
        deadline = time.monotonic() + self.server_wait_timeout
        while idx is None:
            await self._check_servers()
            idx = self._acquire(key)
            if idx is None:
                if time.monotonic() >= deadline:
                    raise InferenceServerError(
                        f"no live inference server for {self.server_wait_timeout:g}s: "
                        f"{self._down_detail()}")
                await asyncio.sleep(0.5)
        return idx

    def _acquire(self, rid: str) -> int | None:
        """The server for key `rid` (its pinned one if live, else the least busy); None if none
        is live."""
        with self._lock:
            idx = self._pinned.get(rid)
            if idx is None or idx in self._down:
                n = len(self.addresses)
                order = [(self._next + k) % n for k in range(n) if (self._next + k) % n not in self._down]
                if not order:
                    return None
                idx = min(order, key=lambda i: self._outstanding[i])
                self._next = (idx + 1) % n
                self._pinned[rid] = idx
                if len(self._pinned) > _MAX_PINNED_RIDS:
                    self._pinned.popitem(last=False)
            self._outstanding[idx] += 1
            if self.timeline is not None and self._outstanding[idx] == 1:
                self.timeline.begin(f"server {idx}", "generate")
            return idx

    def _mark_down(self, idx: int, why: str) -> None:
        if idx not in self._down:
            logger.warning("inference server %s leaves routing: %s", self.addresses[idx], why)
        self._down[idx] = why

    def _down_detail(self) -> str:
        return "; ".join(f"{self.addresses[i]}: {why}" for i, why in sorted(self._down.items()))

    async def _update_all(self, path: str, version: int) -> None:
        self._start_health_task()
        async with self._get_update_lock():
            live = [i for i in range(len(self.addresses)) if i not in self._down]
            if not live:
                raise WeightUpdateError(f"weight update to version {version}: no live inference "
                                        f"server ({self._down_detail()})")
            results = await self._gather([self._update_server(i, path, version) for i in live])
            if any(r is None for r in results):
                self._synced, self._broadcast_version = (path, version), None
        errors = [r for r in results if isinstance(r, BaseException)]
        # A server that could not be reached has left routing; it is loaded with this
        # version before it serves again, so the others carry on without it.
        lost = [e for i, e in zip(live, results) if isinstance(e, WeightUpdateError)
                and isinstance(e.__cause__, ServerUnreachableError) and i in self._down]
        if lost and len(lost) < len(live):
            for e in lost:
                logger.warning("weight update v%d skipped an unreachable server: %s", version, e)
            errors = [e for e in errors if e not in lost]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise WeightUpdateError("; ".join(str(e) for e in errors))

    async def _reachable(self) -> list[str]:
        self._start_health_task()
        returning = [i for i in sorted(self._down) if i not in self._join_failed]
        self._join_failed = set()
        healthy = await self._gather([self._probe(self.addresses[i]) for i in returning])
        back = {i for i, ok in zip(returning, healthy) if ok is True}
        return [a for i, a in enumerate(self.addresses) if i not in self._down or i in back]

    async def _init_group(self, members: list[int], master_address: str, master_port: int,
                          group_name: str, backend: str, bucket_bytes: int) -> None:
        self._start_health_task()
        async with self._get_update_lock():
            self._group = []
            if not members:
                raise WeightUpdateError(f"weight-update group: no live inference server "
                                        f"({self._down_detail()})")
            world = 1 + len(members)
            results = await self._gather([self._join(i, *self._join_request(
                1 + k, world, master_address, master_port, group_name, backend, bucket_bytes))
                for k, i in enumerate(members)])
            failed = {i: r for i, r in zip(members, results) if isinstance(r, BaseException)}
            if failed:
                self._join_failed = set(failed) & set(self._down)  # not retried next time
                raise WeightUpdateError("; ".join(str(e) for e in failed.values()))
            self._group, self._group_name = members, group_name

    async def _join(self, idx: int, path: str, body: dict) -> None:
        address = self.addresses[idx]
        try:
            answer = await self._request(address, path, body, timeout=self.update_weights_timeout)
        except InferenceServerError as e:
            if isinstance(e, ServerUnreachableError):
                self._mark_down(idx, str(e))
            raise WeightUpdateError(f"{address} could not join the weight-update group: "
                                    f"{e}") from e
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightUpdateError(f"{address} could not join the weight-update group: "
                                    f"{answer.get('message', answer)}")

    async def _update_all_broadcast(self, broadcast: WeightBroadcast, version: int) -> None:
        self._start_health_task()
        async with self._get_update_lock():
            members, self._group = self._group, []  # used once; kept only if all succeed
            if not members:
                raise WeightUpdateError(f"weight update to version {version}: no weight-update "
                                        "group (init_weights_update_group first)")
            results = await self._gather([self._update_server(i, broadcast, version)
                                          for i in members])
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                self._group = members
                self._synced, self._broadcast_version = None, version
                for i in members:
                    if self._down.pop(i, None) is not None:
                        logger.info("inference server %s is back in routing at version %d",
                                    self.addresses[i], version)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise WeightUpdateError("; ".join(str(e) for e in errors))

    async def _update_all_ipc(self, update: WeightIpc, version: int) -> None:
        self._start_health_task()
        async with self._get_update_lock():
            members = [self.addresses.index(a) for a in await self._reachable()]
            if not members:
                raise WeightUpdateError(f"weight update to version {version}: no inference "
                                        f"server answers ({self._down_detail()})")
            results = await self._gather([self._update_server(i, update, version)
                                          for i in members])
            done = [i for i, r in zip(members, results) if r is None]
            if done:  # no folder to re-sync from: the others wait for the next update
                self._synced, self._broadcast_version = None, version
            for i in done:
                if self._down.pop(i, None) is not None:
                    logger.info("inference server %s is back in routing at version %d",
                                self.addresses[i], version)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise WeightUpdateError("; ".join(str(e) for e in errors))

    async def _leave_group(self, group_name: str) -> None:
        members, self._group = self._group, []
        path, body = self._leave_request(group_name)
        await self._gather([self._request(self.addresses[i], path, body, retries=0,
                                          timeout=_PROBE_TIMEOUT_S) for i in members])

    async def _update_server(self, idx: int, path: str | WeightBroadcast | WeightIpc,
                             version: int) -> None:
        if self.timeline is not None:
            self.timeline.begin(f"server {idx}", "load weights")
        try:
            await self._update_one(idx, path, version)
        except WeightUpdateError as e:
            if isinstance(e.__cause__, ServerUnreachableError):
                self._mark_down(idx, str(e.__cause__))
            raise
        finally:
            if self.timeline is not None:
                self.timeline.end(f"server {idx}", "load weights")
        self._versions[idx] = version

    async def _check_servers(self) -> None:
        self._start_health_task()
        async with self._get_update_lock():
            await self._gather([self._check_one(i) for i in range(len(self.addresses))])

    async def _check_one(self, idx: int) -> None:
        address = self.addresses[idx]
        if idx not in self._down:
            # Silence or a failed health check count; a late answer does not (a busy server
            # may answer its health check slowly).
            try:
                await self._request(address, self.health_path, None, timeout=_PROBE_TIMEOUT_S,
                                    method="GET", retries=0)
            except (ServerUnreachableError, ServerStatusError) as e:
                self._mark_down(idx, str(e))
            except InferenceServerError:
                pass
            return
        healthy = await self._probe(address)
        if healthy is not True:
            self._down[idx] = str(healthy)
            return
        try:
            held = await self._read_version(address)
            if self._synced is not None and held != self._synced[1]:
                logger.info("re-syncing %s from version %d to %d", address, held, self._synced[1])
                await self._update_one(idx, *self._synced)
                held = self._synced[1]
            elif self._broadcast_version is not None and held != self._broadcast_version:
                self._down[idx] = (f"back at weight version {held}, behind version "
                                   f"{self._broadcast_version} (broadcast or CUDA IPC: no "
                                   "folder to load); it rejoins with the next update")
                return
        except InferenceServerError as e:
            self._down[idx] = f"back, but re-sync failed: {e}"
            return
        self._versions[idx] = held
        del self._down[idx]
        logger.info("inference server %s is back in routing at version %d", address, held)

    async def _probe(self, address: str) -> bool | str:
        """True if the server answers its health check, else why not."""
        try:
            body = await self._request(address, self.health_path, None, timeout=_PROBE_TIMEOUT_S,
                                       method="GET", retries=0)
        except InferenceServerError as e:
            return str(e)
        status = body.get("status", "ok") if isinstance(body, dict) else "ok"
        return True if status == "ok" else f"health status {status!r}"

    def _start_health_task(self) -> None:
        if self.health_check_interval and self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval)
            try:
                await self._check_servers()
            except Exception:  # a failed check must not end the periodic checks
                logger.exception("periodic inference-server check failed")

    def _get_update_lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    async def _shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        if self._session is not None:
            await self._session.close()

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

    async def _on_live(self, fn) -> list[Any]:
        """`fn(address)` on every live server at once; the first error is raised."""
        results = await self._on_client_loop(self._gather([fn(a) for a in self.live_servers]))
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    @staticmethod
    async def _gather(coros: list[Coroutine]) -> list[Any]:
        return await asyncio.gather(*coros, return_exceptions=True)

    async def _request(self, address: str, path: str, payload: Any, *, timeout: float,
                       method: str = "POST", retries: int | None = None,
                       text: bool = False) -> Any:
        """One HTTP call on the client loop; retried (with backoff) only if nobody answers.
        The answer's JSON, or with `text` its body as it is (vLLM's adapter routes answer
        plain text)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        retries = self.request_retries if retries is None else retries
        url = address + path
        for attempt in range(retries + 1):
            try:
                async with self._session.request(method, url, json=payload,
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    body = await r.text()
                    if r.status != 200:
                        raise ServerStatusError(
                            f"{url} answered {r.status}: {error_message(body)}", r.status)
                    if text:
                        return body
                    return json.loads(body) if body.strip() else {}
            except aiohttp.ClientConnectorError as e:
                if attempt == retries:
                    raise ServerUnreachableError(f"inference server {address} cannot be reached "
                                                 f"({retries + 1} attempts): {e}") from e
                await asyncio.sleep(_RETRY_BACKOFF_S * 2 ** attempt)
            except asyncio.TimeoutError as e:
                raise InferenceServerError(f"{url} did not answer within {timeout}s") from e
            except aiohttp.ServerDisconnectedError as e:
                raise ServerUnreachableError(f"{url}: the server disconnected ({e})") from e
            except aiohttp.ClientOSError as e:
                if e.errno in (errno.ECONNRESET, errno.EPIPE):  # its process went away
                    raise ServerUnreachableError(f"{url}: the connection was reset ({e})") from e
                raise InferenceServerError(f"{url} failed: {type(e).__name__}: {e}") from e
            except aiohttp.ClientError as e:
                raise InferenceServerError(f"{url} failed: {type(e).__name__}: {e}") from e
        raise AssertionError("unreachable")

    async def _update_steps(self, idx: int, version: int,
                            steps: list[tuple[str, Callable[[], Awaitable[Any]]]]) -> None:
        """Run named steps in order (the last resumes); on failure resume and raise WeightUpdateError."""
        address = self.addresses[idx]
        name = steps[0][0]
        try:
            for step in steps:
                name = step[0]  # the step that failed, if one does
                await step[1]()
        except InferenceServerError as e:
            if name != steps[-1][0]:
                try:  # leave the server generating (under its old weights) if we can
                    await steps[-1][1]()
                except InferenceServerError:
                    pass
            raise WeightUpdateError(f"weight update to version {version} failed on {address} "
                                    f"at step {name!r}: {e}") from e


def error_message(text: str) -> str:
    """The error text of a JSON error body (ours, vLLM's or SGLang's), else the raw text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail",
                                                              body.get("error_message"))))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:500]
    return text[:500]
