"""The agent service of an RL run: the agent proxy in its own process, and its client.

    python -m asyncrl.agents.service --spec RUN/specs/agent.json --servers URL[,URL...] \
        --host 127.0.0.1 --port 0          # ASYNCRL_ADMIN_KEY (and ASYNCRL_API_KEY) set
    python -m asyncrl.agents.service --spec RUN/specs/agent.json --router URL ...

The proxy (`agent_proxy.AgentProxy`), built from the `AgentServiceSpec` the controller
wrote, generates through the run's router (or its own client
of the inference servers) and records every session token for token. The controller drives it
over HTTP with the admin key, through `AgentClient`:

    POST /rl/start_session {task_id, sampling, admitted: true, start_version}
                                  a session its agent runner already counted (inline,
                                  subprocess): no admission asked
    POST /rl/close_session {session_id, reward?, failure?}
                                  end it; the answer holds every completion
    POST /rl/await_session {version, timeout}
                                  online mode: a grant of one session, counted by the
                                  controller at `version`. The next outside client's
                                  /rl/start_session takes the oldest waiting grant (none
                                  waiting: 429 + Retry-After); the call answers when that
                                  session ends, with the session, or 204 when no client
                                  came within `timeout` (the grant lapses)
    POST /rl/version {version}    the weight version the servers now serve
    POST /rl/servers {index, address}
                                  server `index` was restarted at `address` (and re-synced)

Started by the run's scheduler (`scheduler.agent`), like the servers and trainer ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from asyncrl.agents.export import SessionWriter
from asyncrl.agents.proxy import (
    AgentProxy,
    CloseOutcome,
    _error,
    _rl_body,
    serve_until_signalled,
)
from asyncrl.agents.session import Session
from asyncrl.config import ConfigError, GenerationConfig
from asyncrl.config.schema import AgentConfig
from asyncrl.config.specfile import read_spec
from asyncrl.inference.gateway import load_tokenizer
from asyncrl.inference.router import add_inference_args, inference_engine
from asyncrl.models.hub import resolve_model_path
from asyncrl.openai.drift import check_template_drift
from asyncrl.openai.images import load_image_prompts

logger = logging.getLogger(__name__)
GRANT_TIMEOUT = 30.0  # seconds an online grant waits for a client before it lapses


@dataclass(frozen=True, kw_only=True)
class AgentServiceSpec:
    """What the run's agent proxy reads of its config (here, or inline in the controller)."""

    agent: AgentConfig
    gconfig: GenerationConfig  # what every session samples with
    model_name: str  # actor.path: the model the OpenAI routes name
    tokenizer_path: str
    max_model_len: int  # local_engine.max_seq_len
    max_session_version_lag: int | None  # rollout.max_session_version_lag
    # How the service reaches the servers (rollout.*): its backend's client and limits.
    backend: Literal["local", "vllm", "sglang"]
    request_timeout: float
    request_retries: int


def forced_sampling(g: GenerationConfig, eos_token_id: int | None) -> dict[str, Any]:
    """What every training session samples with, whatever the agent asks: the trainer's
    temperature (its log-probs assume it), top_p/top_k, and the token budget as a cap."""
    stops = list(g.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])
    return {"temperature": g.effective_temperature, "top_p": g.top_p, "top_k": g.top_k,
            "max_new_tokens": g.max_new_tokens, "stop_token_ids": stops}


def build_proxy(spec: AgentServiceSpec, tokenizer: Any, engine: Any, *,
                version: Callable[[], int], admin_key: str | None) -> AgentProxy:
    """The proxy of an RL run as `spec` says (in the controller or in this service)."""
    a = spec.agent
    writer = (SessionWriter(a.export_dir, style=a.export_style, discount=a.turn_discount)
              if a.export_dir else None)
    return AgentProxy(
        engine, tokenizer, model_name=spec.model_name, admin_key=admin_key, version=version,
        session_timeout=a.session_timeout,
        max_session_version_lag=spec.max_session_version_lag,
        max_model_len=spec.max_model_len,
        sampling=forced_sampling(spec.gconfig, tokenizer.eos_token_id), on_end=writer,
        tool_parser=a.tool_parser,
        images=load_image_prompts(resolve_model_path(spec.tokenizer_path)))


# -- the service --------------------------------------------------------------------------


@dataclass
class _Grant:
    version: int
    bound: asyncio.Future  # resolves to the session that took the grant


class Grants:
    """The proxy's admission in an online run served by this process: a client's session
    may start only on a grant the controller holds open (`/rl/await_session`)."""

    def __init__(self) -> None:
        self.waiting: deque[_Grant] = deque()

    def admit(self, start: Callable[[int], Session]) -> Session | None:
        while self.waiting:
            grant = self.waiting.popleft()
            if grant.bound.done():  # lapsed, or its caller went away
                continue
            session = start(grant.version)
            grant.bound.set_result(session)
            return session
        return None


class AgentService:
    """The proxy's routes plus the controller's: versions, servers, online grants."""

    def __init__(self, proxy: AgentProxy, engine: Any) -> None:
        self.proxy, self.engine = proxy, engine
        self.version = 0
        self.grants = Grants()
        proxy.version = lambda: self.version
        proxy.admission = self.grants
        proxy.extra_routes = [web.post("/rl/version", self._set_version),
                              web.post("/rl/servers", self._set_server),
                              web.post("/rl/await_session", self._await_session)]

    async def _admin_body(self, request: web.Request, allowed: set[str]) -> dict | web.Response:
        """The JSON body of a controller call (admin key only; only `allowed` fields)."""
        if not self.proxy.is_admin(request):
            return _error(401, "missing or wrong admin key", code="invalid_api_key")
        return await _rl_body(request, allowed)

    async def _set_version(self, request: web.Request) -> web.Response:
        body = await self._admin_body(request, {"version"})
        if isinstance(body, web.Response):
            return body
        v = body.get("version")
        if not _is_count(v):
            return _error(400, f"version must be an integer >= 0, got {v!r}", param="version")
        self.version = v
        return web.json_response({"version": v})

    async def _set_server(self, request: web.Request) -> web.Response:
        body = await self._admin_body(request, {"index", "address"})
        if isinstance(body, web.Response):
            return body
        index, address = body.get("index"), body.get("address")
        n = len(self.engine.addresses)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            return _error(400, f"index must be a server index in [0, {n}), got {index!r}",
                          param="index")
        if not isinstance(address, str) or not address:
            return _error(400, "address must be the server's URL", param="address")
        self.engine.replace_server(index, address)
        await self.engine.check_servers()
        return web.json_response({"index": index, "address": self.engine.addresses[index]})

    async def _await_session(self, request: web.Request) -> web.Response:
        body = await self._admin_body(request, {"version", "timeout"})
        if isinstance(body, web.Response):
            return body
        version, timeout = body.get("version"), body.get("timeout", GRANT_TIMEOUT)
        if not _is_count(version):
            return _error(400, f"version must be an integer >= 0, got {version!r}",
                          param="version")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            return _error(400, f"timeout must be a number of seconds > 0, got {timeout!r}",
                          param="timeout")
        grant = _Grant(version, asyncio.get_running_loop().create_future())
        self.grants.waiting.append(grant)
        try:
            session = await asyncio.wait_for(asyncio.shield(grant.bound), timeout)
        except asyncio.TimeoutError:
            if not grant.bound.done():
                grant.bound.cancel()
                return web.Response(status=204)
            session = grant.bound.result()  # taken as the wait ran out
        finally:
            if not grant.bound.done():  # the caller went away: the grant lapses
                grant.bound.cancel()
        await session.done
        return web.json_response({"session": session.to_record()})


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def serve(spec: AgentServiceSpec, args: argparse.Namespace, admin_key: str) -> None:
    """Serve the run's proxy until SIGTERM/SIGINT; active sessions end as cancelled.

    It generates through the run's router when there is one, else its own client of the
    servers."""
    engine = inference_engine(args, spec.backend, request_timeout=spec.request_timeout,
                              request_retries=spec.request_retries)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    proxy = build_proxy(spec, tokenizer, engine, version=lambda: 0, admin_key=admin_key)
    AgentService(proxy, engine)  # adds its routes and admission to the proxy
    logger.info("%s", check_template_drift(tokenizer, proxy.routes.native_tools).describe())
    await serve_until_signalled(proxy, engine, args.host, args.port, "asyncrl agent service")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.agents.service",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True,
                   help="the proxy's AgentServiceSpec as JSON (<run>/specs/agent.json)")
    add_inference_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    admin_key = os.environ.get("ASYNCRL_ADMIN_KEY")
    if not admin_key:
        p.error("ASYNCRL_ADMIN_KEY must be set: it guards the controller's /rl/* routes")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = read_spec(AgentServiceSpec, args.spec)
    except ConfigError as err:
        p.error(str(err))
    asyncio.run(serve(spec, args, admin_key))


# -- the client ---------------------------------------------------------------------------


class AgentServiceError(RuntimeError):
    """The agent service answered an error or could not be reached."""


class AgentClient:
    """The controller's handle on the agent service (an agent workflow's `SessionHost`).

    Its coroutines run on the rollout loop (one aiohttp session there).
    """

    def __init__(self, address: str, admin_key: str, *, timeout: float = 60.0,
                 wait_timeout: float = 120.0) -> None:
        self.move(address)
        self.timeout = timeout
        # Seconds a session call waits for a service it cannot connect to (dead, being
        # restarted by the trainer) before it fails.
        self.wait_timeout = wait_timeout
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._http: aiohttp.ClientSession | None = None
        self._abandoned: set[asyncio.Task] = set()
        self._closed = False

    def move(self, address: str) -> None:
        """The service is (now) at `address` (it was restarted there)."""
        self.address = address.rstrip("/")
        self.base_url = self.address + "/v1"

    async def _post(self, path: str, body: dict[str, Any], *, timeout: float | None = -1.0,
                    wait: bool = False) -> dict[str, Any] | None:
        """POST `path`; `timeout` seconds (default: the client's; None: no limit). `wait`:
        while the service cannot be connected to, try again for up to `wait_timeout`."""
        deadline = asyncio.get_running_loop().time() + (self.wait_timeout if wait else 0.0)
        while True:
            try:
                return await self._post_once(path, body, timeout)
            except AgentServiceError as e:
                if not isinstance(e.__cause__, aiohttp.ClientConnectorError) \
                        or asyncio.get_running_loop().time() >= deadline:
                    raise
            await asyncio.sleep(0.5)

    async def _post_once(self, path: str, body: dict[str, Any],
                         timeout: float | None) -> dict[str, Any] | None:
        if self._http is None:
            self._http = aiohttp.ClientSession(headers=self._headers)
        total = self.timeout if timeout == -1.0 else timeout
        try:
            async with self._http.post(self.address + path, json=body,
                                       timeout=aiohttp.ClientTimeout(total=total)) as resp:
                if resp.status == 204:
                    return None
                text = await resp.text()
                if resp.status != 200:
                    raise AgentServiceError(f"agent service {self.address}{path} answered "
                                            f"{resp.status}: {text[:500]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AgentServiceError(f"agent service {self.address}{path} failed: "
                                    f"{type(e).__name__}: {e}") from e

    async def open(self, *, task_id: str, sampling: dict[str, Any],
                   start_version: int | None = None) -> tuple[str, str]:
        body: dict[str, Any] = {"task_id": task_id, "sampling": sampling, "admitted": True}
        if start_version is not None:
            body["start_version"] = start_version
        out = await self._post("/rl/start_session", body, wait=True)
        return out["session_id"], out["api_key"]

    async def close(self, session_id: str, *, reward: float | None = None,
                    failure: str | None = None) -> tuple[CloseOutcome, Session]:
        body: dict[str, Any] = {"session_id": session_id}
        if reward is not None:
            body["reward"] = reward
        if failure is not None:
            body["failure"] = failure
        out = await self._post("/rl/close_session", body, wait=True)
        return out["outcome"], Session.from_record(out["session"])

    def abandon(self, session_id: str, reason: str) -> None:
        if self._closed:  # the run is ending: the service ends its sessions as cancelled
            return

        async def close() -> None:
            try:
                await self.close(session_id, failure=reason)
            except AgentServiceError as e:
                logger.warning("could not end session %s: %s", session_id, e)
        task = asyncio.get_running_loop().create_task(close())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)

    async def await_session(self, version: int, timeout: float = GRANT_TIMEOUT
                            ) -> Session | None:
        """Hold one grant open at `version`; the session that took it, once ended, or None.

        No limit on the wait here: the service answers when the grant lapses or its session
        ends (its idle timeout ends a silent one), and a dead service drops the connection."""
        out = await self._post("/rl/await_session", {"version": version, "timeout": timeout},
                               timeout=None)
        return None if out is None else Session.from_record(out["session"])

    async def set_version(self, version: int) -> None:
        await self._post("/rl/version", {"version": version})

    async def replace_server(self, index: int, address: str) -> None:
        await self._post("/rl/servers", {"index": index, "address": address})

    async def stats(self) -> dict[str, float]:
        if self._http is None:
            self._http = aiohttp.ClientSession(headers=self._headers)
        try:
            async with self._http.get(self.address + "/rl/sessions",
                                      timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    raise AgentServiceError(f"agent service /rl/sessions answered {r.status}")
                return (await r.json())["counts"]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AgentServiceError(f"agent service {self.address}/rl/sessions failed: "
                                    f"{type(e).__name__}: {e}") from e

    async def close_client(self) -> None:
        self._closed = True
        if self._abandoned:
            await asyncio.gather(*self._abandoned, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None


if __name__ == "__main__":
    main()
