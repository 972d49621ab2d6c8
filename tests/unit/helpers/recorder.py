"""A loopback stand-in for vLLM's and SGLang's HTTP endpoints that records what it is sent."""

from aiohttp import web


class Recorder:
    """Answers every request with {"success": true} and records (path, body)."""

    def __init__(self):
        self.calls: list[tuple[str, dict | None]] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{path:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path_qs, body))
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        return web.json_response({"success": True})
