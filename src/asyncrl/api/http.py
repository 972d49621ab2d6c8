"""Serving an aiohttp application until a signal: shared by the engine's server and services."""

from __future__ import annotations

import asyncio
import hmac
import signal
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

PUBLIC_PATHS = ("/", "/health", "/openapi.json")  # answered without the API key


def key_matches(request: web.Request, api_key: str) -> bool:
    """Constant-time check of the request's key: `Authorization: Bearer <key>` (OpenAI's
    clients) or `x-api-key: <key>` (Anthropic's)."""
    given = request.headers.get("Authorization", "")
    if not given and "x-api-key" in request.headers:
        given = f"Bearer {request.headers['x-api-key']}"
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def bearer_auth(api_key: str | None, open_paths: tuple[str, ...] = ("/health",)):
    """aiohttp middleware: every path but `open_paths` needs `Authorization: Bearer <api_key>`
    (none needed when `api_key` is None); 401 otherwise."""
    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key and request.path not in open_paths:
            got = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(got.encode(), api_key.encode()):
                return web.json_response({"error": {
                    "type": "Unauthorized",
                    "message": "missing or wrong API key (Authorization: Bearer <key>)"}},
                    status=401)
        return await handler(request)
    return auth


# Seconds a shutting-down server lets requests in progress finish before it cancels them
# (aiohttp's default is 60: a stopping agent proxy held the run's exit while agents still
# waited on generations).
SHUTDOWN_GRACE_S = 3.0


async def serve_app(app: web.Application, *, host: str, port: int, banner: str,
                    before_cleanup: Callable[[], Awaitable[None]] | None = None,
                    stop: asyncio.Event | None = None) -> None:
    """Serve `app` until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly.

    Prints "<banner> listening on http://HOST:PORT" once bound (callers that pass port 0
    parse it). `before_cleanup()` runs before the server closes its connections.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    # Signal handlers can only be installed from the main thread (tests serve from others).
    in_main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGTERM, signal.SIGINT) if in_main else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0]
    print(f"{banner} listening on http://{bound[0]}:{bound[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if before_cleanup is not None:
            await before_cleanup()
        await runner.cleanup()
