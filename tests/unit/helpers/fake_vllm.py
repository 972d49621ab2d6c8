"""Loopback stand-ins for vLLM servers: the endpoints the vLLM client uses, no model.

/v1/completions "samples" one token every `token_s` seconds: token i of a request is
len(prompt) + i, with log-prob -(version + 1), so a test can tell which weights sampled it.
/pause?mode=abort ends every request in flight with finish_reason "abort" (as vLLM does)
and holds new ones until /resume. /v1/load_lora_adapter and /v1/unload_lora_adapter keep
`adapters[server]` (name -> path) and answer plain text, as vLLM's; a completion whose
"model" names no loaded adapter answers 404, as vLLM's does.
"""

import asyncio
import threading

from aiohttp import web


class FakeVLLMServers:
    def __init__(self, n: int, token_s: float = 0.02):
        self.token_s = token_s
        self.calls: list[tuple[int, str, dict]] = []  # (server, path, body)
        self.versions = [0] * n
        self.healthy = [True] * n  # False: /health answers 503
        self.errors = [False] * n  # True: /v1/completions answers 500 (with healthy: a dead engine)
        self.addresses: list[str] = []
        self.adapters: list[dict[str, str]] = [{} for _ in range(n)]
        self._paused: list[asyncio.Event] = []  # set while running
        self._aborts: list[int] = []  # abort-pauses so far, per server
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(n, ready), daemon=True).start()
        ready.wait(10)

    def _run(self, n: int, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        for i in range(n):
            self._paused.append(asyncio.Event())
            self._paused[i].set()
            self._aborts.append(0)
            app = web.Application()
            app.add_routes([web.post(p, self._handler(i, p)) for p in (
                "/v1/completions", "/pause", "/resume", "/collective_rpc",
                "/update_weight_version", "/v1/load_lora_adapter",
                "/v1/unload_lora_adapter")] + [
                web.get("/weight_info", self._handler(i, "/weight_info")),
                web.get("/health", self._handler(i, "/health"))])
            runner = web.AppRunner(app)
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
            self.addresses.append("http://%s:%d" % runner.addresses[0][:2])
        ready.set()
        self.loop.run_forever()

    def _handler(self, i: int, path: str):
        async def handle(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            self.calls.append((i, path, body))
            if path == "/v1/completions":
                if self.errors[i]:
                    return web.json_response({"error": {"message": "EngineCore encountered an "
                                                        "issue."}}, status=500)
                if "model" in body and body["model"] not in self.adapters[i]:
                    return web.json_response({"error": {"message": f"The model `{body['model']}`"
                                                        " does not exist."}}, status=404)
                return web.json_response(await self._complete(i, body))
            if path == "/v1/load_lora_adapter":
                self.adapters[i][body["lora_name"]] = body["lora_path"]
                return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added "
                                         "successfully.")
            if path == "/v1/unload_lora_adapter":
                del self.adapters[i][body["lora_name"]]
                return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed "
                                         "successfully.")
            if path == "/pause":
                self._paused[i].clear()
                if request.query.get("mode", "abort") == "abort":
                    self._aborts[i] += 1  # every request running now ends at its next token
                    await asyncio.sleep(2 * self.token_s)  # and answers before the pause does
            elif path == "/resume":
                self._paused[i].set()
            elif path == "/update_weight_version":
                self.versions[i] = int(body["new_version"])
            elif path == "/weight_info":
                return web.json_response({"weight_version": str(self.versions[i])})
            elif path == "/health" and not self.healthy[i]:
                return web.json_response({"error": "engine dead"}, status=503)
            return web.json_response({})
        return handle

    async def _complete(self, i: int, body: dict) -> dict:
        await self._paused[i].wait()
        started = self._aborts[i]
        ids: list[int] = []
        finish = "length"
        for k in range(body["max_tokens"]):
            await asyncio.sleep(self.token_s)
            if self._aborts[i] != started:
                finish = "abort"
                break
            ids.append(len(body["prompt"]) + k)
        lps = [-(self.versions[i] + 1.0)] * len(ids)
        return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps},
                             "finish_reason": finish}]}
