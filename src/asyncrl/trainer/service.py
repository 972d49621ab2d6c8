"""The training service: one process per trainer rank, and the controller's client of them.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m asyncrl.trainer.service --spec <run>/specs/trainer.json --port 0

Each process hosts an `RLWorker` (trainer/worker.py), built from the `TrainerSpec` the
controller wrote (the run's config as one rank reads it), and answers, in the order received
and one at a time (a rank's engine calls are collectives that every rank must enter in the
same order):

    GET  /health                      {"status": "ok", "initialized": bool}
    GET  /info                        rank, world size, optimiser steps taken
    POST /initialize {total_steps}    load and shard the models (joins the process group)
    POST /train            <batch>    one RL step; the `train/` (and `critic/`) stats
    POST /compute_logprobs <batch>    the actor's log-probs, as a safetensors body
    POST /save_hf {path, dtype?, with_critic?}  the actor (and critic) as HF folders
    POST /save_state {path}           /load_state {path}: exact-resume state
    POST /destroy                     free the engines and the process group
    POST /weights/connect {master_address, master_port, world_size, timeout, group_name,
                           backend, dtype}   rank 0 hosts the broadcast group of the servers
    POST /weights/gather {bucket_bytes}   every rank gathers the weights; rank 0 answers the
                                          bucket layout the servers are to receive
    POST /weights/broadcast           rank 0 sends the buckets (bounded by the timeout)
    POST /weights/close               leave the broadcast group
    POST /weights/free_port {host}    a port free on this rank's host (the rendezvous's)
    POST /weights/ipc {dtype}         one rank: its weights in a GPU buffer shared by CUDA
                                      IPC; the body of a server's IPC update (weights/ipc.py)

Control is JSON; a batch travels as the bytes of a safetensors file of the `TensorBatch`
fields (`encode_batch`), never as JSON numbers. When every rank is on the client's host the
bytes are written once to shared memory (/dev/shm) and each rank is sent the file's name
({"batch_file": path}, only files named asyncrl-batch-* there are read). Paths to write or
read must lie under cluster.fileroot (the spec's `fileroot`). If $ASYNCRL_API_KEY is set,
every route but /health and /openapi.json (the description, api/openapi.py) needs
`Authorization: Bearer <key>`. A bad body answers 400, a path that does not exist 404, a
call before the one it needs (/initialize, /weights/connect) 409, and a failing call 500,
each with the error and the rank; `TrainingClient` raises it naming the rank and address.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from asyncrl.api import openapi
from asyncrl.api.http import PUBLIC_PATHS, key_matches, serve_app
from asyncrl.api.types import TensorBatch
from asyncrl.config import ConfigError
from asyncrl.config.specfile import read_spec
from asyncrl.observe.paths import fileroot
from asyncrl.trainer.worker import RLWorker, TrainerSpec
from asyncrl.weights.broadcast import BroadcastError, WeightSender, free_port
from asyncrl.weights.ipc import IpcUnavailable
from asyncrl.weights.transport import BucketLayout

logger = logging.getLogger(__name__)

_BATCH_FIELDS = [f.name for f in fields(TensorBatch)]
_BINARY = "application/octet-stream"


class TrainingServiceError(RuntimeError):
    """A trainer rank failed a call, did not answer in time, or could not be reached."""


def encode_batch(tb: TensorBatch) -> bytes:
    """The batch's tensors (fields left at None are left out) as safetensors bytes."""
    tensors = {name: getattr(tb, name).contiguous() for name in _BATCH_FIELDS
               if getattr(tb, name) is not None}
    return save_safetensors(tensors)


def decode_batch(data: bytes) -> TensorBatch:
    """The inverse of `encode_batch`; ValueError naming what is missing or unknown."""
    try:
        tensors = load_safetensors(data)
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"the request body is not a safetensors batch: {err}") from None
    unknown = sorted(set(tensors) - set(_BATCH_FIELDS))
    if unknown:
        raise ValueError(f"the batch has unknown fields {unknown}; TensorBatch fields are "
                         f"{_BATCH_FIELDS}")
    required = [f.name for f in fields(TensorBatch) if f.default is not None]
    if missing := [name for name in required if name not in tensors]:
        raise ValueError(f"the batch lacks the fields {missing}")
    return TensorBatch(**tensors)


_SHM = "/dev/shm"
_SHM_PREFIX = "asyncrl-batch-"


def batch_from_request(body: bytes, content_type: str) -> TensorBatch:
    """A batch sent as safetensors bytes, or as {"batch_file": path} in shared memory."""
    if content_type != "application/json":
        return decode_batch(body)
    try:
        path = json.loads(body)["batch_file"]
    except (ValueError, KeyError, TypeError):
        raise ValueError('a JSON batch must be {"batch_file": "<path under /dev/shm>"}') from None
    name = os.path.basename(str(path))
    if os.path.dirname(str(path)) != _SHM or not name.startswith(_SHM_PREFIX):
        raise ValueError(f"batch_file must be {_SHM}/{_SHM_PREFIX}*, got {path!r}")
    with open(path, "rb") as f:
        return decode_batch(f.read())


def _local_host(address: str) -> bool:
    host = urllib.parse.urlsplit(address).hostname or ""
    return host == "localhost" or host.startswith("127.")


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype {name!r} is not one of bfloat16, float16, float32")
    return getattr(torch, name)


# ---- the service (one per rank) -------------------------------------------------------


class NotReady(RuntimeError):
    """A call that needs an earlier one first (/initialize, /weights/connect): 409."""


class TrainingService:
    """HTTP routes over one `RLWorker`; its calls run one at a time on a worker thread.

    The paths it writes and reads (/save_hf, /save_state, /load_state) must lie under
    `root`, the runs' folder (cluster.fileroot); None: anywhere.
    """

    def __init__(self, worker: Any, *, api_key: str | None = None,
                 root: str | os.PathLike | None = None) -> None:
        self.worker = worker
        self.api_key = api_key
        self.root = None if root is None else Path(root).resolve()
        self.initialized = False
        self.rank = int(os.environ.get("RANK", "0"))
        # One thread: the worker's calls are collectives, taken in the order they arrive.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self.app = web.Application(middlewares=[self._errors], client_max_size=2**34)
        self.app.add_routes([
            web.get("/health", self.health), web.get("/info", self.info),
            web.get("/openapi.json", self.openapi),
            web.post("/initialize", self.initialize), web.post("/train", self.train),
            web.post("/compute_logprobs", self.compute_logprobs),
            web.post("/save_hf", self.save_hf), web.post("/save_state", self.save_state),
            web.post("/load_state", self.load_state), web.post("/destroy", self.destroy),
            web.post("/weights/connect", self.weights_connect),
            web.post("/weights/gather", self.weights_gather),
            web.post("/weights/broadcast", self.weights_broadcast),
            web.post("/weights/close", self.weights_close),
            web.post("/weights/free_port", self.weights_free_port),
            web.post("/weights/ipc", self.weights_ipc),
        ])
        self.sender = None  # weights.broadcast.WeightSender, made by /weights/connect

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key and request.path not in PUBLIC_PATHS \
                and not key_matches(request, self.api_key):
            return web.json_response({"error": "missing or wrong API key", "rank": self.rank},
                                     status=401)
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except NotReady as err:
            return web.json_response({"error": str(err), "rank": self.rank}, status=409)
        except FileNotFoundError as err:
            return web.json_response({"error": f"not found: {err}", "rank": self.rank},
                                     status=404)
        except (ValueError, KeyError, TypeError, NotADirectoryError, IsADirectoryError,
                FileExistsError) as err:
            return web.json_response({"error": f"bad request: {err}", "rank": self.rank},
                                     status=400)
        except Exception as err:
            logger.exception("%s failed", request.path)
            return web.json_response({"error": f"{type(err).__name__}: {err}",
                                      "rank": self.rank}, status=500)

    async def _run(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise NotReady("the trainer is not initialised; POST /initialize first")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "initialized": self.initialized})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.training_service(api_key=bool(self.api_key)))

    async def info(self, request: web.Request) -> web.Response:
        self._require_initialized()
        return web.json_response(await self._run(self.worker.info))

    async def initialize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        total_steps = body["total_steps"]
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
        out = await self._run(self.worker.initialize, total_steps)
        self.initialized = True
        return web.json_response(out)

    async def train(self, request: web.Request) -> web.Response:
        self._require_initialized()
        tb = batch_from_request(await request.read(), request.content_type)
        return web.json_response(await self._run(self.worker.train, tb))

    async def compute_logprobs(self, request: web.Request) -> web.Response:
        self._require_initialized()
        tb = batch_from_request(await request.read(), request.content_type)
        logprobs = await self._run(self.worker.compute_logprobs, tb)
        return web.Response(body=save_safetensors({"logprobs": logprobs.contiguous()}),
                            content_type=_BINARY)

    async def save_hf(self, request: web.Request) -> web.Response:
        self._require_initialized()
        body = await _json(request)
        await self._run(functools.partial(self.worker.save_hf, self._path(body),
                                          _dtype(body.get("dtype")),
                                          with_critic=bool(body.get("with_critic", False))))
        return web.json_response({"ok": True})

    async def save_state(self, request: web.Request) -> web.Response:
        self._require_initialized()
        await self._run(self.worker.save_state, self._path(await _json(request)))
        return web.json_response({"ok": True})

    async def load_state(self, request: web.Request) -> web.Response:
        self._require_initialized()
        await self._run(self.worker.load_state, self._path(await _json(request)))
        return web.json_response({"ok": True})

    async def weights_connect(self, request: web.Request) -> web.Response:
        self._require_initialized()
        body = await _json(request)
        if self.sender is None or self.sender.backend != body.get("backend", "gloo"):
            self.sender = WeightSender(self.rank, backend=body.get("backend", "gloo"),
                                       dtype=_dtype(body.get("dtype", "bfloat16")))
        await self._run(self.sender.connect, body["master_address"], int(body["master_port"]),
                        int(body["world_size"]), float(body["timeout"]),
                        body.get("group_name") or "weight_update_group")
        return web.json_response({"ok": True})

    async def weights_gather(self, request: web.Request) -> web.Response:
        self._require_initialized()
        if self.sender is None:
            raise NotReady("no broadcast group: POST /weights/connect first")
        bucket_bytes = int((await _json(request))["bucket_bytes"])
        layout = await self._run(self.sender.gather, self.worker, bucket_bytes)
        return web.json_response({"layout": layout.to_body() if layout is not None else None})

    async def weights_broadcast(self, request: web.Request) -> web.Response:
        if self.sender is None:
            raise NotReady("no broadcast group: POST /weights/connect first")
        return web.json_response(await self._run(self.sender.broadcast))

    async def weights_free_port(self, request: web.Request) -> web.Response:
        return web.json_response({"port": free_port(_str(await _json(request), "host"))})

    async def weights_close(self, request: web.Request) -> web.Response:
        if self.sender is not None:
            self.sender.close()
        return web.json_response({"ok": True})

    async def weights_ipc(self, request: web.Request) -> web.Response:
        self._require_initialized()

        dtype = _str(await _json(request), "dtype")
        _dtype(dtype)  # one of ours, else 400
        try:
            return web.json_response(await self._run(self.worker.ipc_weights, dtype))
        except IpcUnavailable as err:  # a CPU rank: the request cannot be met here
            raise ValueError(str(err)) from None

    def _path(self, body: dict[str, Any]) -> str:
        """The body's `path`, which must lie under the runs' folder."""
        path = _str(body, "path")
        if self.root is not None:
            resolved = Path(path).resolve()
            if not resolved.is_relative_to(self.root):
                raise ValueError(f"path {path!r} is outside the runs' folder {self.root} "
                                 "(cluster.fileroot)")
            return str(resolved)
        return path

    async def destroy(self, request: web.Request) -> web.Response:
        if self.initialized:
            await self._run(self.worker.destroy)
            self.initialized = False
        return web.json_response({"ok": True})


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def _str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"'{key}' must be a non-empty string")
    return value


# ---- the controller's client ----------------------------------------------------------


class TrainingClient:
    """Drives every rank of the training service alike: the controller's trainer handle.

    Each call goes to all ranks at once and returns rank 0's answer; it raises
    `TrainingServiceError` naming the first rank that failed or did not answer within
    `timeout` seconds.
    """

    def __init__(self, addresses: Sequence[str], *, timeout: float = 3600.0,
                 api_key: str | None = None) -> None:
        if not addresses:
            raise ValueError("TrainingClient needs the address of at least one trainer rank")
        self.addresses = [a.rstrip("/") for a in addresses]
        self.timeout = timeout
        self.api_key = api_key
        self._pool = ThreadPoolExecutor(max_workers=len(self.addresses),
                                        thread_name_prefix="trainer-client")
        # Batches go through /dev/shm when every rank shares this host.
        self.shared_memory = os.path.isdir(_SHM) and all(map(_local_host, self.addresses))

    def _request(self, address: str, route: str, body: bytes | None, content_type: str,
                 timeout: float) -> bytes:
        headers = {"Content-Type": content_type}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(address + route, data=body, headers=headers,
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except (ValueError, AttributeError):
                pass
            raise TrainingServiceError(f"trainer {address}{route} answered {err.code}: "
                                       f"{detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise TrainingServiceError(f"trainer {address}{route} failed: {err} (the rank's "
                                       "process may have died; see its log)") from None

    def _all(self, route: str, body: bytes | None = None, content_type: str = "application/json",
             timeout: float | None = None) -> bytes:
        """POST (GET without body) `route` on every rank; rank 0's answer."""
        timeout = self.timeout if timeout is None else timeout
        futures = [self._pool.submit(self._request, a, route, body, content_type, timeout)
                   for a in self.addresses]
        # The first failure is reported at once: its peers may be stuck in a collective.
        done, pending = wait(futures, timeout=timeout + 5, return_when=FIRST_EXCEPTION)
        for rank, future in enumerate(futures):
            if future in done and future.exception() is not None:
                raise TrainingServiceError(f"rank {rank}: {future.exception()}")
        if pending:
            late = [rank for rank, f in enumerate(futures) if f in pending]
            raise TrainingServiceError(f"trainer ranks {late} ({[self.addresses[r] for r in late]})"
                                       f" did not answer {route} within {timeout:.0f} s")
        results = [f.result() for f in futures]
        return results[0]

    def _json_all(self, route: str, payload: dict[str, Any] | None = None, **kw) -> Any:
        body = json.dumps(payload or {}).encode()
        return json.loads(self._all(route, body, **kw))

    def initialize(self, total_steps: int) -> dict[str, int]:
        return self._json_all("/initialize", {"total_steps": total_steps})

    def train(self, tb: TensorBatch) -> dict[str, float]:
        return json.loads(self._batch_all("/train", tb))

    def compute_logprobs(self, tb: TensorBatch) -> torch.Tensor:
        return load_safetensors(self._batch_all("/compute_logprobs", tb))["logprobs"]

    def _batch_all(self, route: str, tb: TensorBatch) -> bytes:
        """Send `tb` to every rank: once through shared memory when all are on this host
        (with more than one rank), else as each request's body."""
        data = encode_batch(tb)
        if len(self.addresses) < 2 or not self.shared_memory:
            return self._all(route, data, _BINARY)
        fd, path = tempfile.mkstemp(prefix=_SHM_PREFIX, dir=_SHM)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return self._all(route, json.dumps({"batch_file": path}).encode())
        finally:
            os.unlink(path)

    def save_hf(self, path: str, dtype: torch.dtype | None = None, *,
                with_critic: bool = False) -> None:
        payload: dict[str, Any] = {"path": str(path), "with_critic": with_critic}
        if dtype is not None:
            payload["dtype"] = str(dtype).removeprefix("torch.")
        self._json_all("/save_hf", payload)

    def save_state(self, path: str) -> None:
        self._json_all("/save_state", {"path": str(path)})

    def load_state(self, path: str) -> None:
        self._json_all("/load_state", {"path": str(path)})

    def info(self) -> dict[str, Any]:
        return json.loads(self._all("/info"))

    def ipc_weights(self, dtype: str) -> dict[str, Any]:
        """Rank 0's weights shared by CUDA IPC (one rank: weight_update_mode=ipc)."""
        return self._rank0("/weights/ipc", {"dtype": dtype})

    def weight_sender(self, backend: str, dtype: str) -> tuple[RemoteWeightSender, str]:
        """The broadcast's trainer side (rank 0 hosts the group) and rank 0's host."""
        host = urllib.parse.urlsplit(self.addresses[0]).hostname or "127.0.0.1"
        return RemoteWeightSender(self, backend=backend, dtype=dtype), host

    def _rank0(self, route: str, payload: dict[str, Any] | None = None) -> Any:
        body = json.dumps(payload or {}).encode()
        try:
            return json.loads(self._request(self.addresses[0], route, body, "application/json",
                                            self.timeout))
        except TrainingServiceError as err:
            raise TrainingServiceError(f"rank 0: {err}") from None

    def destroy(self, timeout: float = 60.0) -> None:
        """Free the ranks' engines (best effort: a dead rank is logged, not raised)."""
        try:
            self._json_all("/destroy", timeout=timeout)
        except TrainingServiceError as err:
            logger.warning("could not destroy the trainer ranks cleanly: %s", err)
        self._pool.shutdown(wait=False, cancel_futures=True)


class RemoteWeightSender:
    """`weights.broadcast.WeightSender`'s interface over the training service's ranks, for
    `BroadcastPublisher`: rank 0 hosts the group and sends; every rank gathers."""

    def __init__(self, client: TrainingClient, *, backend: str = "gloo",
                 dtype: str = "bfloat16") -> None:
        self.client, self.backend, self.dtype = client, backend, dtype
        self._group: _RemoteGroup | None = None

    @property
    def connected(self) -> bool:
        return self._group is not None

    def open_group(self, master_address: str, master_port: int, world_size: int,
                   timeout: float, group_name: str) -> _RemoteGroup:
        try:
            self.client._json_all("/weights/connect", {
                "master_address": master_address, "master_port": master_port,
                "world_size": world_size, "timeout": timeout, "group_name": group_name,
                "backend": self.backend, "dtype": self.dtype}, timeout=timeout + 30)
        except TrainingServiceError as err:
            raise BroadcastError(f"weight-update group at {master_address}:{master_port}: "
                                 f"{err}") from None
        return _RemoteGroup(self.client)

    def free_port(self, host: str) -> int:
        """A port free on rank 0's host (where the group's rendezvous listens)."""
        return int(self.client._rank0("/weights/free_port", {"host": host})["port"])

    def adopt(self, group: _RemoteGroup) -> None:
        self.close()
        self._group = group

    def send(self, actor: Any, *, bucket_bytes: int, on_layout=None) -> dict[str, float]:
        """Every rank gathers (the ranks hold the actor: `actor` is unused); rank 0's layout
        goes to `on_layout` (the servers start receiving), then rank 0 broadcasts."""
        t0 = time.monotonic()
        try:
            layout = self.client._json_all("/weights/gather", {"bucket_bytes": bucket_bytes})
            t1 = time.monotonic()
            if on_layout is not None:
                on_layout(BucketLayout.from_body(layout["layout"]))
            stats = self.client._rank0("/weights/broadcast")
        except TrainingServiceError as err:
            self.close()
            raise BroadcastError(f"broadcast from the trainer ranks failed: {err}") from None
        return stats | {"perf/weights_gather_s": t1 - t0,
                        "perf/weights_broadcast_s": time.monotonic() - t1}

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()


class _RemoteGroup:
    def __init__(self, client: TrainingClient) -> None:
        self.client = client

    def close(self) -> None:
        """Leave the group on every rank (in the background: a rank may be stuck)."""
        def leave() -> None:
            try:
                self.client._json_all("/weights/close", timeout=30)
            except TrainingServiceError as err:
                logger.warning("could not leave the weight-update group: %s", err)

        threading.Thread(target=leave, name="asyncrl-weight-group-leave", daemon=True).start()


# ---- the process ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncrl.trainer.service",
                                description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True,
                   help="the rank's TrainerSpec as JSON (<run>/specs/trainer.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; RANK/WORLD_SIZE/MASTER_* from the scheduler, the key from $ASYNCRL_API_KEY."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        spec = read_spec(TrainerSpec, args.spec)
    except ConfigError as err:
        parser.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    service = TrainingService(RLWorker(spec), api_key=os.environ.get("ASYNCRL_API_KEY") or None,
                              root=fileroot(spec.fileroot))
    rank = os.environ.get("RANK", "0")
    asyncio.run(serve_app(service.app, host=args.host, port=args.port,
                          banner=f"asyncrl training service rank {rank}"))


if __name__ == "__main__":
    main()
