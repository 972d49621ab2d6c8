"""The inference service's router: the run's servers (any backend) behind one address.

    python -m asyncrl.inference.router --backend local --servers URL[,URL...] \
        --host 127.0.0.1 --port 0                       # ASYNCRL_API_KEY guards it (optional)

It hosts the backend's client (`inference/client/`: least-busy routing, request and session
affinity, /health polling, removal and re-admission with re-sync, resubmission across
weight updates) and serves it over HTTP, so the controller and the agent service route
through one place and see the same servers:

    POST /generate {rid, input_ids, sampling, affinity?}      -> GenerationResponse
    POST /pause, /resume                                      every live server
    POST /update_weights_from_disk {path, version}
    POST /reachable_servers                                   -> {servers}
    POST /init_weights_update_group {master_address, master_port, servers, bucket_bytes,
                                     backend, group_name}
    POST /update_weights_from_distributed {layout, version, group_name}
    POST /destroy_weights_update_group {group_name}
    POST /check_servers                                       -> {live}
    POST /replace_server {index, address}
    GET  /state    {backend, addresses, live, down, weight_group, weight_group_name}
    GET  /version  the lowest version across live servers
    GET  /health   200 while a server is live, else 503

Errors come back as {"error": {"type", "message"}} (502 for a server's failure) and
`RouterClient` raises them as the client would have (InferenceServerError,
WeightUpdateError, ...), so the controller handles them the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from asyncrl.api.errors import InferenceError
from asyncrl.api.http import bearer_auth, serve_app
from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.inference.client import base
from asyncrl.inference.client.backends import client_class
from asyncrl.inference.client.base import (
    GROUP_NAME,
    InferenceServerError,
    normalise_address,
)

logger = logging.getLogger(__name__)
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (InferenceError, base.InferenceServerError,
                                  base.ServerUnreachableError, base.ServerStatusError,
                                  base.WeightUpdateError)}
_MAX_BODY = 256 * 2**20  # a broadcast layout of a large model is a big JSON body


def _error(status: int, message: str, kind: str = "BadRequest") -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


class RouterService:
    """The HTTP face of one backend client over the run's servers."""

    def __init__(self, engine: Any, backend: str, api_key: str | None = None) -> None:
        self.engine, self.backend, self.api_key = engine, backend, api_key

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[bearer_auth(self.api_key)])
        post = {
            "/generate": self._generate,
            "/pause": self._call(lambda b: self.engine.pause()),
            "/resume": self._call(lambda b: self.engine.resume()),
            "/update_weights_from_disk": self._call(self._update_from_disk, "path", "version"),
            "/reachable_servers": self._call(self._reachable),
            "/init_weights_update_group": self._call(
                lambda b: self.engine.init_weights_update_group(
                    b["master_address"], b["master_port"], servers=b["servers"],
                    bucket_bytes=b["bucket_bytes"], backend=b.get("backend", "gloo"),
                    group_name=b.get("group_name", GROUP_NAME)),
                "master_address", "master_port", "servers", "bucket_bytes"),
            "/update_weights_from_distributed": self._call(self._update_from_broadcast,
                                                           "layout", "version"),
            "/destroy_weights_update_group": self._call(
                lambda b: self.engine.destroy_weights_update_group(
                    b.get("group_name", GROUP_NAME))),
            "/check_servers": self._call(self._check),
            "/replace_server": self._call(self._replace, "index", "address"),
        }
        app.add_routes([web.post(path, handler) for path, handler in post.items()])
        app.add_routes([web.get("/state", self._state), web.get("/version", self._version),
                        web.get("/health", self._health)])
        return app

    def state(self) -> dict[str, Any]:
        e = self.engine
        return {"backend": self.backend, "addresses": list(e.addresses),
                "live": e.live_servers, "down": e.down_servers,
                "weight_group": e.weight_group, "weight_group_name": e.weight_group_name}

    async def _body(self, request: web.Request, required: tuple[str, ...]) -> dict | web.Response:
        try:
            body = await request.json() if await request.read() else {}
        except ValueError:
            return _error(400, "the body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        missing = [k for k in required if k not in body]
        if missing:
            return _error(400, f"missing field {missing[0]!r}")
        return body

    def _call(self, fn: Callable[[dict], Awaitable[Any]], *required: str):
        """A route that awaits `fn(body)` and answers its result (dict) and the state."""
        async def handler(request: web.Request) -> web.Response:
            body = await self._body(request, required)
            if isinstance(body, web.Response):
                return body
            try:
                out = await fn(body)
            except InferenceError as e:
                return _error(502, str(e), type(e).__name__)
            except (KeyError, TypeError, ValueError) as e:
                return _error(400, f"{type(e).__name__}: {e}")
            return web.json_response({**(out or {}), "state": self.state()})
        return handler

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("input_ids",))
        if isinstance(body, web.Response):
            return body
        try:
            req = GenerationRequest.from_dict(body)
            req.affinity = body.get("affinity")
        except (TypeError, ValueError) as e:
            return _error(400, f"bad generation request: {e}")
        try:
            resp = await self.engine.agenerate(req)
        except InferenceError as e:
            return _error(502, str(e), type(e).__name__)
        return web.json_response(resp.to_dict())

    async def _update_from_disk(self, body: dict) -> None:
        await self.engine.update_weights_from_disk(body["path"], body["version"])
        self._updated(body["version"], f"from {body['path']}")

    async def _update_from_broadcast(self, body: dict) -> None:
        await self.engine.update_weights_from_distributed(
            body["layout"], body["version"], group_name=body.get("group_name", GROUP_NAME))
        self._updated(body["version"], "by broadcast")

    def _updated(self, version: int, how: str) -> None:
        live = self.engine.live_servers
        logger.info("weights version %d %s on %d server(s): %s", version, how, len(live),
                    ", ".join(live))

    async def _reachable(self, body: dict) -> dict:
        return {"servers": await self.engine.reachable_servers()}

    async def _check(self, body: dict) -> dict:
        return {"live": await self.engine.check_servers()}

    async def _replace(self, body: dict) -> dict:
        index, n = body["index"], len(self.engine.addresses)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"index must be a server index in [0, {n}), got {index!r}")
        self.engine.replace_server(index, str(body["address"]))
        return {}

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def _version(self, request: web.Request) -> web.Response:
        try:
            return web.json_response({"version": await self.engine.get_version()})
        except InferenceError as e:
            return _error(502, str(e), type(e).__name__)

    async def _health(self, request: web.Request) -> web.Response:
        live = self.engine.live_servers
        return web.json_response({"status": "ok" if live else "no live server", "live": live},
                                 status=200 if live else 503)


async def serve(backend: str, servers: list[str], *, host: str, port: int,
                api_key: str | None, request_timeout: float, request_retries: int,
                update_weights_timeout: float, health_check_interval: float | None) -> None:
    engine = client_class(backend)(
        servers, request_timeout=request_timeout, request_retries=request_retries,
        update_weights_timeout=update_weights_timeout,
        health_check_interval=health_check_interval, api_key=api_key)
    await serve_app(RouterService(engine, backend, api_key).app(), host=host, port=port,
                    banner="asyncrl router", before_cleanup=engine.close)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.inference.router",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="local", choices=("local", "vllm", "sglang"))
    p.add_argument("--servers", required=True, help="the inference servers, comma-separated")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--request-retries", type=int, default=3)
    p.add_argument("--update-weights-timeout", type=float, default=300.0)
    p.add_argument("--health-check-interval", type=float, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.backend, [s for s in args.servers.split(",") if s],
                      host=args.host, port=args.port,
                      api_key=os.environ.get("ASYNCRL_API_KEY") or None,
                      request_timeout=args.request_timeout,
                      request_retries=args.request_retries,
                      update_weights_timeout=args.update_weights_timeout,
                      health_check_interval=args.health_check_interval))


# -- the client ---------------------------------------------------------------------------


def add_inference_args(parser: argparse.ArgumentParser) -> None:
    """--router URL | --servers URL,...: what a service generates or publishes through."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", help="the run's router (inference/router.py)")
    where.add_argument("--servers", help="the inference servers, comma-separated")


def inference_engine(args: argparse.Namespace, backend: str, **kwargs: Any) -> Any:
    """The run's router's client (`args.router`), else `backend`'s client of `args.servers`;
    the servers' key is $ASYNCRL_API_KEY (a service guarded by its own key passes `api_key`)."""
    key = kwargs.pop("api_key", os.environ.get("ASYNCRL_API_KEY") or None)
    if args.router:
        kwargs.pop("request_retries", None)
        return RouterClient(args.router, api_key=key, state=fetch_state(args.router, key),
                            **kwargs)
    return client_class(backend)([a for a in args.servers.split(",") if a], api_key=key,
                                 **kwargs)


def fetch_state(address: str, api_key: str | None = None, timeout: float = 30.0) -> dict:
    """The router's /state, fetched without an event loop (to build a `RouterClient`)."""
    import json
    import urllib.request

    req = urllib.request.Request(normalise_address(address) + "/state", headers=(
        {"Authorization": f"Bearer {api_key}"} if api_key else {}))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class RouterClient:
    """The controller's (and the agent service's) inference engine when a router serves the
    run: the same methods as a backend client, each one HTTP call to the router.

    `addresses`, `weight_group`, `weight_group_name` and `live_servers` are the router's
    state as of the last call (`refresh` fetches it)."""

    # Requests' images go to the router, whose backend client refuses them if it sends none.
    serves_images = True

    def __init__(self, address: str, *, api_key: str | None = None,
                 request_timeout: float = 3600.0, update_weights_timeout: float = 300.0,
                 state: dict[str, Any] | None = None) -> None:
        self.address = normalise_address(address)
        self.request_timeout = request_timeout
        self.update_weights_timeout = update_weights_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._state: dict[str, Any] = state or {}
        self._replaced: list[tuple[int, str]] = []  # restarts not yet told to the router

    # ---- state ----------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self._state["backend"]

    @property
    def addresses(self) -> list[str]:
        return list(self._state.get("addresses", []))

    @property
    def live_servers(self) -> list[str]:
        return list(self._state.get("live", []))

    @property
    def weight_group(self) -> list[str]:
        return list(self._state.get("weight_group", []))

    @property
    def weight_group_name(self) -> str | None:
        return self._state.get("weight_group_name")

    async def refresh(self) -> dict[str, Any]:
        self._state = await self._call("GET", "/state", None, self.request_timeout)
        return self._state

    # ---- the engine -----------------------------------------------------------------------

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        body = {**req.to_dict(), "affinity": req.affinity}
        return GenerationResponse.from_dict(
            await self._call("POST", "/generate", body, self.request_timeout))

    async def pause(self) -> None:
        await self._post("/pause", {})

    async def resume(self) -> None:
        await self._post("/resume", {})

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        await self._post("/update_weights_from_disk", {"path": path, "version": version})

    async def reachable_servers(self) -> list[str]:
        return (await self._post("/reachable_servers", {}))["servers"]

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        servers: list[str], bucket_bytes: int,
                                        backend: str = "gloo",
                                        group_name: str = GROUP_NAME) -> None:
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "servers": servers,
            "bucket_bytes": bucket_bytes, "backend": backend, "group_name": group_name})

    async def update_weights_from_distributed(self, layout: dict[str, Any], version: int, *,
                                              group_name: str = GROUP_NAME) -> None:
        await self._post("/update_weights_from_distributed",
                         {"layout": layout, "version": version, "group_name": group_name})

    async def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def check_servers(self) -> list[str]:
        return (await self._post("/check_servers", {}))["live"]

    def replace_server(self, idx: int, address: str) -> None:
        """Server `idx` was restarted at `address`: told to the router before the next call
        (the caller's `check_servers`, which re-syncs it there)."""
        self._replaced.append((idx, address))

    async def get_version(self) -> int:
        return (await self._call("GET", "/version", None, self.request_timeout))["version"]

    async def wait_healthy(self, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await self.refresh()
                if self.live_servers:
                    return
                why = f"no live server: {self._state.get('down')}"
            except InferenceError as e:
                why = str(e)
            if asyncio.get_running_loop().time() >= deadline:
                raise InferenceServerError(f"router {self.address} not ready after "
                                           f"{timeout}s: {why}")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._http_loop = None

    # ---- HTTP -----------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        while self._replaced:
            idx, address = self._replaced[0]
            await self._call("POST", "/replace_server", {"index": idx, "address": address},
                             self.request_timeout)
            self._replaced.pop(0)
        out = await self._call("POST", path, body, self.update_weights_timeout * 2 + 30)
        self._state = out.get("state", self._state)
        return out

    async def _call(self, method: str, path: str, body: Any, timeout: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http, self._http_loop = aiohttp.ClientSession(headers=self._headers), loop
        try:
            async with self._http.request(method, self.address + path, json=body,
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                out = await r.json(content_type=None)
                if r.status == 200:
                    return out
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise base.ServerUnreachableError(
                f"router {self.address}{path}: {type(e).__name__}: {e}") from e
        err = out.get("error", {}) if isinstance(out, dict) else {}
        cls = _ERRORS.get(err.get("type"), InferenceServerError)
        raise cls(f"router {self.address}{path} answered {r.status}: {err.get('message', out)}")


if __name__ == "__main__":
    main()
