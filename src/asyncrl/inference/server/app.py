"""HTTP server around `LocalEngine` (aiohttp).

    python -m asyncrl.inference.server.app --model smollm2-135m-instruct --port 8000

Endpoints: POST /generate, /pause, /resume, /update_weights; GET /health, /version;
and OpenAI's GET /v1/models, POST /v1/completions, /v1/chat/completions (openai/routes.py).
Weight sync by broadcast, with SGLang's names and bodies (weights/transport.py has the wire
format): POST /init_weights_update_group joins the trainer's group, POST
/update_weights_from_distributed receives every bucket and then serves the new weights
under `weight_version` (all or nothing), POST /destroy_weights_update_group leaves it; GET
/weights_checksum gives the served version and a sha256 of its weights.
Weight sync by CUDA IPC (a trainer on this server's GPU; weights/ipc.py): POST
/update_weights_from_ipc {layout fields, ipc_handle, weight_version} copies the trainer's
shared buffer into the spare weights and serves them under `weight_version` (all or
nothing); it answers once the copies have run, so the trainer may then rewrite its buffer.
If $ASYNCRL_API_KEY is set, every endpoint but /health needs `Authorization: Bearer <key>`.
Handlers never run model code: /generate awaits a future that the engine thread resolves
(via call_soon_threadsafe); blocking engine calls run in the default executor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch
from aiohttp import web

from asyncrl.api import openapi
from asyncrl.api.cores import CoreShare
from asyncrl.api.http import PUBLIC_PATHS, key_matches, serve_app
from asyncrl.api.types import GenerationRequest, ImageInputs, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.cpu_decode import huge_empty
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.local_backend import LocalBackend
from asyncrl.inference.server.model import CheckpointError, check_tensors, hf_shapes
from asyncrl.openai.images import load_image_prompts
from asyncrl.openai.routes import OpenAIRoutes, unauthorized
from asyncrl.weights import ipc, transport

logger = logging.getLogger(__name__)
_SAMPLING_FIELDS = {f.name: f.type for f in fields(SamplingParams)}


class BadRequest(ValueError):
    """A request body that does not match the endpoint's schema."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _failure(status: int, message: str) -> web.Response:
    """An error in SGLang's shape ({"success": false, "message"}) and ours ({"error"})."""
    return web.json_response({"success": False, "message": message, "error": message},
                             status=status)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(t) for t in x)


def parse_generation_request(body: Any) -> GenerationRequest:
    """Validate a /generate body; BadRequest names the offending field."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(body) - {"rid", "input_ids", "sampling", "images"}
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}")
    if not _is_int_list(body.get("input_ids")) or not body["input_ids"]:
        raise BadRequest("input_ids must be a non-empty list of integers")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    sampling = body.get("sampling", {})
    if not isinstance(sampling, dict):
        raise BadRequest("sampling must be an object")
    for key, value in sampling.items():
        if key not in _SAMPLING_FIELDS:
            raise BadRequest(
                f"sampling.{key} is not a sampling parameter ({sorted(_SAMPLING_FIELDS)})")
        ok = {"max_new_tokens": _is_int(value), "top_k": _is_int(value),
              "temperature": isinstance(value, (int, float)) and not isinstance(value, bool),
              "top_p": isinstance(value, (int, float)) and not isinstance(value, bool),
              "stop_token_ids": _is_int_list(value),
              "stop": isinstance(value, list) and all(isinstance(s, str) for s in value),
              "ignore_eos": isinstance(value, bool),
              "seed": value is None or _is_int(value)}[key]
        if not ok:
            raise BadRequest(f"sampling.{key} has the wrong type: {value!r}")
    try:
        params = SamplingParams(**sampling)  # range checks; messages name the field
    except ValueError as e:
        raise BadRequest(f"sampling: {e}") from None
    extra = {"rid": rid} if rid else {}
    if body.get("images") is not None:
        images = body["images"]
        if not isinstance(images, dict) or "pixel_values" not in images:
            raise BadRequest("images must be an object with pixel_values (and optionally "
                             "pixel_attention_mask), each {shape, data}")
        try:
            extra["images"] = ImageInputs.from_dict(images)
        except ValueError as e:
            raise BadRequest(f"images: {e}") from None
    return GenerationRequest(input_ids=body["input_ids"], sampling=params, **extra)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # UTF-8 is JSON's encoding
        raise BadRequest(f"body is not valid JSON: {e}") from None


def _version(value: Any) -> int:
    """A weight version given as an integer or, as SGLang sends it, a string of one."""
    if _is_int(value):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise BadRequest(f"weight_version must be an integer (or a string of one), got {value!r}")


def _field(body: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key, default)
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise BadRequest(f"{key} must be {'an integer' if kind is int else f'a {kind.__name__}'}, "
                         f"got {value!r}")
    return value


def _settle(fut: asyncio.Future, result: Any) -> None:
    if fut.done():  # the handler went away
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


class InferenceServer:
    """The aiohttp application of one engine."""

    def __init__(self, engine: LocalEngine, *, model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.app = web.Application(middlewares=[self._auth, self._errors])
        self.app.add_routes([
            web.post("/generate", self.generate), web.post("/pause", self.pause),
            web.post("/resume", self.resume), web.post("/update_weights", self.update_weights),
            web.get("/health", self.health), web.get("/version", self.version),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.post("/update_weights_from_ipc", self.update_weights_from_ipc),
            web.get("/weights_checksum", self.weights_checksum),
            web.get("/openapi.json", self.openapi),
        ])
        # Weight-update groups by name, with their timeout; one broadcast update at a time.
        self._groups: dict[str, tuple[Any, float]] = {}
        self._receiving = asyncio.Lock()
        self._buffers: list[torch.Tensor] = []  # receive buffers, kept for the next update
        self.ipc = ipc.IpcImporter()  # the trainer's shared buffer, mapped (CUDA IPC)
        images = load_image_prompts(engine.model_path) if engine.vision is not None else None
        OpenAIRoutes(LocalBackend(engine), engine.tokenizer, model_name,
                     max_model_len=engine.config.max_seq_len, images=images).add_to(self.app)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path not in PUBLIC_PATHS \
                and not key_matches(request, self.api_key):
            if request.path.startswith("/v1/"):  # OpenAI clients expect their error shape
                return unauthorized()
            return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(400, str(e))

    async def generate(self, request: web.Request) -> web.Response:
        req = parse_generation_request(await _json_body(request))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self.engine.submit(req, lambda r: loop.call_soon_threadsafe(_settle, fut, r))
        except ValueError as e:  # prompt too long, ids outside the vocabulary
            raise BadRequest(str(e)) from None
        try:
            resp = await fut
        except RuntimeError as e:  # the engine shut down
            return _error(503, f"generation failed: {e}")
        except Exception as e:  # a failed engine step: report it rather than a bare 500
            return _error(500, f"generation failed: {type(e).__name__}: {e}")
        return web.json_response(resp.to_dict())

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.inference_server(self.model_name,
                                                          api_key=bool(self.api_key)))

    async def pause(self, request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.pause)
        return web.json_response({"paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"paused": False})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise BadRequest("path must be a string (a folder of *.safetensors)")
        if not _is_int(body.get("version")):
            raise BadRequest("version must be an integer")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.engine.update_weights, body["path"],
                                       body["version"])
        except (OSError, ValueError) as e:  # unreadable folder, CheckpointError
            return _error(400, f"weight update to version {body['version']} failed: {e}")
        return web.json_response({"version": self.engine.version})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group as rank `rank_offset`, leaving any other
        (SGLang's body; plus `timeout`, seconds for joining and for each later broadcast,
        default 300)."""
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        address = _field(body, "master_address", str)
        port, rank = _field(body, "master_port", int), _field(body, "rank_offset", int)
        world = _field(body, "world_size", int)
        name = _field(body, "group_name", str, transport.GROUP_NAME)
        backend = _field(body, "backend", str, "gloo")
        timeout = body.get("timeout", 300.0)
        if not 1 <= rank < world:
            raise BadRequest(f"rank_offset must be in [1, world_size), got {rank} of {world}")
        if backend != "gloo":
            raise BadRequest(f"backend must be 'gloo' (this server receives into CPU memory), "
                             f"got {backend!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise BadRequest(f"timeout must be a positive number of seconds, got {timeout!r}")
        for old in list(self._groups):  # a server is in one trainer's group at a time
            self._leave(old)
        join = functools.partial(transport.join_group, backend=backend, master_address=address,
                                 master_port=port, rank=rank, world_size=world, group_name=name,
                                 timeout=float(timeout))
        try:
            group = await asyncio.get_running_loop().run_in_executor(None, join)
        except (RuntimeError, ValueError) as e:  # DistStoreError: the trainer never came
            return _failure(500, f"joining weight-update group {name!r} at {address}:{port} as "
                            f"rank {rank} of {world} failed: {e}")
        self._groups[name] = (group, float(timeout))
        return web.json_response({"success": True,
                                  "message": f"joined {name!r} as rank {rank} of {world}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive every bucket from the trainer, then serve the weights as `weight_version`.

        The tensors go into spare buffers as their buckets arrive and are swapped in only
        once all have come: if the trainer dies or stalls (past the group's timeout), the
        update fails, the old weights and version stay, and the group is left (a new one
        is made for the next update).
        """
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        name = _field(body, "group_name", str, transport.GROUP_NAME)
        version = _version(body.get("weight_version"))
        try:
            layout = transport.BucketLayout.from_body(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if name not in self._groups:
            return _failure(400, f"no weight-update group {name!r}: POST "
                            "/init_weights_update_group first")
        group, timeout = self._groups[name]
        async with self._receiving:
            try:  # before any byte comes: a layout that does not fit would derail the stream
                check_tensors(dict(zip(layout.names, layout.shapes)),
                              hf_shapes(self.engine.model.cfg), "the broadcast's layout",
                              self.engine.model.cfg.foreign_prefixes)
                await asyncio.get_running_loop().run_in_executor(
                    None, self._receive, group, layout, timeout, version)
            except (CheckpointError, RuntimeError) as e:
                self._leave(name)  # its connections close: the trainer's side fails at once
                message = f"weight update to version {version} by broadcast failed: {e}"
                logger.warning("%s; still serving version %d", message, self.engine.version)
                return _failure(400 if isinstance(e, CheckpointError) else 500, message)
        return web.json_response({"success": True, "version": self.engine.version,
                                  "message": f"received {len(layout.names)} tensors in "
                                             f"{len(layout.buckets)} buckets"})

    def _receive(self, group: Any, layout: transport.BucketLayout, timeout: float,
                 version: int) -> None:
        need = layout.buffer_sizes()  # two: the next bucket arrives while one is unpacked
        if len(self._buffers) != len(need) or any(
                b.numel() < n for b, n in zip(self._buffers, need)):
            self._buffers = []  # freed before the new ones are made
            self._buffers = [huge_empty((n,), torch.uint8) for n in need]
        tensors = transport.receive_buckets(group, layout, self._buffers, timeout)
        self.engine.load_weights(tensors, version)

    async def update_weights_from_ipc(self, request: web.Request) -> web.Response:
        """Copy the weights a trainer on this GPU shares by CUDA IPC and serve them as
        `weight_version`; answered once the copies have run (the trainer's buffer is free)."""
        body = await _json_body(request)
        try:
            layout, handle = ipc.parse_update(body)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        version = _version(body.get("weight_version"))
        async with self._receiving:
            try:
                check_tensors(dict(zip(layout.names, layout.shapes)),
                              hf_shapes(self.engine.model.cfg), "the IPC update's layout",
                              self.engine.model.cfg.foreign_prefixes)
                await asyncio.get_running_loop().run_in_executor(
                    None, self._load_shared, layout, handle, version)
            except (CheckpointError, ipc.IpcUnavailable) as e:
                message = f"weight update to version {version} by CUDA IPC failed: {e}"
                return _failure(400, message)
            except RuntimeError as e:  # a CUDA error opening or reading the buffer
                message = f"weight update to version {version} by CUDA IPC failed: {e}"
                logger.warning("%s; still serving version %d", message, self.engine.version)
                return _failure(500, message)
        return web.json_response({"success": True, "version": self.engine.version,
                                  "message": f"copied {len(layout.names)} tensors"})

    def _load_shared(self, layout: transport.BucketLayout, handle: ipc.IpcHandle,
                     version: int) -> None:
        buffer = self.ipc.open(handle, self.engine.device)
        try:
            self.engine.load_weights(layout.unpack(0, buffer), version)
        finally:
            ipc.wait_for_copies(self.engine.device)  # before the trainer writes it again

    def _leave(self, name: str) -> None:
        """Forget group `name` and destroy it in the background (that may wait on a peer)."""
        entry = self._groups.pop(name, None)
        if entry is not None:
            threading.Thread(target=transport.leave_group, args=(entry[0],), daemon=True).start()

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request) if request.can_read_body else {}
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        name = _field(body, "group_name", str, transport.GROUP_NAME)
        if name not in self._groups:
            return _failure(400, f"no weight-update group {name!r}")
        self._leave(name)
        return web.json_response({"success": True, "message": f"left {name!r}"})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        digest = await asyncio.get_running_loop().run_in_executor(None, self.engine.weights_digest)
        return web.json_response(digest)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, **self.engine.stats(),
                                  "kv_slots": self.engine.config.max_batch_size})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.engine.version})


async def run_server(engine: LocalEngine, *, host: str, port: int, model_name: str,
                     api_key: str | None, stop: asyncio.Event | None = None) -> None:
    """Serve `engine` until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly."""
    server = InferenceServer(engine, model_name=model_name, api_key=api_key)

    async def close_engine() -> None:
        engine.close()  # fails requests in flight, so their handlers answer before cleanup
        server.ipc.close()  # the trainer's buffer, unmapped

    app = server.app
    await serve_app(app, host=host, port=port, banner="asyncrl inference server",
                    before_cleanup=close_engine, stop=stop)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000,
          config: LocalEngineConfig | None = None, seed: int = 0, threads: int | None = None,
          api_key: str | None = None, device: str = "auto",
          gpu_memory_fraction: float | None = None) -> None:
    """Load `model` (a name or HF folder), start the engine and serve HTTP until signalled.

    `gpu_memory_fraction` (CUDA): the engine's share of its GPU's memory
    (inference/server/memory.py)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # Cores lent and borrowed on demand (api/cores.py) when the scheduler set up a share.
    share = CoreShare.from_env(home=threads or torch.get_num_threads()) \
        if device == "cpu" else None
    # The model is loaded and run in the engine's thread; this one only serves HTTP.
    engine = LocalEngine.spawn(model, config, seed=seed, device=device, threads=threads,
                               share=share, gpu_memory_fraction=gpu_memory_fraction)
    # Everything loaded so far lives as long as the server: keep the cyclic garbage
    # collector from walking it again on every collection (it showed up at ~2% of decode).
    gc.freeze()
    asyncio.run(run_server(engine, host=host, port=port, model_name=model, api_key=api_key))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m asyncrl.inference.server.app`."""
    p = argparse.ArgumentParser(prog="python -m asyncrl.inference.server.app",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help="HF folder or named model (e.g. smollm2-135m-instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-batch-size", type=int, default=LocalEngineConfig.max_batch_size)
    p.add_argument("--max-seq-len", type=int, default=LocalEngineConfig.max_seq_len)
    p.add_argument("--no-recompute-kv-on-update", action="store_true",
                   help="keep the stale KV cache of in-flight sequences after a weight update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto: cuda if present")
    p.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="CUDA: the share of the GPU's memory this server may take; the KV "
                        "cache gets what weights and a step leave of it (fewer slots than "
                        "--max-batch-size if they do not fit)")
    args = p.parse_args(argv)
    if args.gpu_memory_fraction is not None and not 0 < args.gpu_memory_fraction < 1:
        p.error(f"--gpu-memory-fraction must be in (0, 1), got {args.gpu_memory_fraction}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; the API key comes from $ASYNCRL_API_KEY."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    config = LocalEngineConfig(dtype=args.dtype, max_batch_size=args.max_batch_size,
                               max_seq_len=args.max_seq_len,
                               recompute_kv_on_update=not args.no_recompute_kv_on_update)
    serve(args.model, host=args.host, port=args.port, config=config, seed=args.seed,
          threads=args.threads, api_key=os.environ.get("ASYNCRL_API_KEY") or None,
          device=args.device, gpu_memory_fraction=args.gpu_memory_fraction)


if __name__ == "__main__":
    main()
