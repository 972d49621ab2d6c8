"""The weight-update service: carries each version from the trainer ranks to the servers.

    python -m asyncrl.controller.weight_update --spec RUN/specs/weight_update.json \
        --trainer URL[,URL...] (--router URL | --servers URL[,URL...]) --host H --port 0
    # ASYNCRL_API_KEY guards it; ASYNCRL_TRAINER_KEY / ASYNCRL_INFERENCE_KEY reach the others

It pairs the training service's ranks with the inference servers (through the run's router,
or its own client of them) and runs `actor.weight_update_mode` between them, as the
`WeightUpdateSpec` the controller wrote says:
- disk: rank 0 writes `<run>/weights/v<N>/`, every server pauses, loads it, sets N, resumes;
- broadcast: a process group of rank 0 and every server, every rank gathering in lockstep,
  bucketed, each step bounded by `rollout.update_weights_timeout`.

    POST /publish {version}   -> the publish's timings ({"perf/weights_*_s": ...})
    POST /close               leave the broadcast group
    GET  /health

One publish at a time; the controller waits for it (`WeightUpdateClient.publish`). A failed
publish answers 502 naming the server or rank and the step, and leaves every server on its
previous version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from asyncrl.api.errors import InferenceError
from asyncrl.api.http import bearer_auth, serve_app
from asyncrl.config import ConfigError
from asyncrl.config.specfile import read_spec
from asyncrl.inference.router import add_inference_args, inference_engine
from asyncrl.trainer.service import TrainingClient
from asyncrl.weights import make_publisher, transfer_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WeightUpdateSpec:
    """What the weight-update service reads of the run's config."""

    mode: Literal["disk", "broadcast", "ipc"]  # actor.weight_update_mode
    backend: Literal["local", "vllm", "sglang"]  # rollout.backend
    cuda: bool  # the servers are on GPUs (cluster.n_gpus_per_node > 0): the broadcast's group
    weights_dir: str  # <run>/weights: disk mode's versions
    dtype: Literal["bfloat16", "float32", "float16"]  # local_engine.dtype: what is published
    bucket_mb: int  # actor.weight_update_bucket_mb
    update_weights_timeout: float  # rollout.update_weights_timeout
    trainer_timeout: float  # scheduler.trainer_timeout


class WeightUpdateError(RuntimeError):
    """A publish through the weight-update service failed (the message says where)."""


class WeightUpdateService:
    """`POST /publish` runs the run's publisher on one worker thread."""

    def __init__(self, publisher: Any, trainer: Any, api_key: str | None) -> None:
        self.publisher, self.trainer, self.api_key = publisher, trainer, api_key
        self._busy = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bearer_auth(self.api_key)])
        app.add_routes([web.post("/publish", self._publish), web.post("/close", self._close),
                        web.get("/health", self._health)])
        return app

    async def _publish(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body must be JSON: {\"version\": N}")
        version = body.get("version") if isinstance(body, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return _error(400, f"version must be an integer >= 0, got {version!r}")
        async with self._busy:
            loop = asyncio.get_running_loop()
            try:
                stats = await loop.run_in_executor(
                    None, self.publisher.publish, self.trainer, version)
            except (InferenceError, RuntimeError, OSError) as e:
                logger.error("publish of version %d failed: %s", version, e)
                return _error(502, f"{type(e).__name__}: {e}")
        logger.info("version %d published: %s", version,
                    ", ".join(f"{k.removeprefix('perf/')}={v:.3f}" for k, v in stats.items()))
        return web.json_response(stats)

    async def _close(self, request: web.Request) -> web.Response:
        async with self._busy:
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)
        return web.json_response({"closed": True})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "publishing": self._busy.locked()})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def serve(spec: WeightUpdateSpec, args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    engine = inference_engine(args, spec.backend,
                              update_weights_timeout=spec.update_weights_timeout,
                              api_key=os.environ.get("ASYNCRL_INFERENCE_KEY") or None)
    trainer = [a for a in args.trainer.split(",") if a]
    ranks = TrainingClient(trainer, api_key=os.environ.get("ASYNCRL_TRAINER_KEY") or None,
                           timeout=spec.trainer_timeout)
    sender, master = None, "127.0.0.1"
    if spec.mode == "broadcast":
        sender, master = ranks.weight_sender(transfer_backend(spec.backend, cuda=spec.cuda),
                                             spec.dtype)
    publisher = make_publisher(
        spec.mode, engine, root=Path(spec.weights_dir), dtype=spec.dtype,
        bucket_mb=spec.bucket_mb, timeout=spec.update_weights_timeout,
        master_address=master, sender=sender,
        run=lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result())
    service = WeightUpdateService(publisher, ranks, os.environ.get("ASYNCRL_API_KEY") or None)

    async def before_cleanup() -> None:
        await loop.run_in_executor(None, publisher.close)
        await engine.close()
    await serve_app(service.app(), host=args.host, port=args.port, banner="asyncrl weight update",
                    before_cleanup=before_cleanup)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.controller.weight_update",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True,
                   help="the service's WeightUpdateSpec as JSON (<run>/specs/weight_update.json)")
    p.add_argument("--trainer", required=True, help="the training service's ranks, in order")
    add_inference_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = read_spec(WeightUpdateSpec, args.spec)
    except ConfigError as err:
        p.error(str(err))
    asyncio.run(serve(spec, args))


class WeightUpdateClient:
    """The controller's publisher when the weight-update service carries the versions:
    `publish(trainer, version)` as `weights.make_publisher`'s publishers (the trainer ranks
    are the service's own, so `trainer` is not used)."""

    def __init__(self, address: str, *, api_key: str | None, timeout: float) -> None:
        self.address = address.rstrip("/")
        self.timeout = timeout
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def publish(self, trainer: Any, version: int) -> dict[str, float]:
        return self._post("/publish", {"version": version})

    def close(self) -> None:
        try:
            self._post("/close", {})
        except WeightUpdateError as e:  # the service may be gone already at shutdown
            logger.debug("weight-update service close: %s", e)

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.address + route, data=json.dumps(body).encode(),
                                     headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise WeightUpdateError(f"weight-update service {self.address}{route} answered "
                                    f"{err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise WeightUpdateError(f"weight-update service {self.address}{route} failed: "
                                    f"{err}") from None


if __name__ == "__main__":
    main()
