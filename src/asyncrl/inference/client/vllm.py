"""Client for vLLM's OpenAI-compatible server (vLLM >= 0.32, CPU or GPU build).

Endpoints used (the server needs VLLM_SERVER_DEV_MODE=1 for /collective_rpc):
- POST /v1/completions with a token-id prompt, `logprobs: 0` and `return_token_ids: true`:
  `choices[0].token_ids` and `choices[0].logprobs.token_logprobs` are the sampled tokens and
  their log-probs (the server runs with --logprobs-mode processed_logprobs, so they are
  log_softmax(logits / T), as the trainer recomputes them).
- A prompt with images (an Idefics3-like or Qwen2-VL-like model; the server is started
  with --enable-scale-out): POST /inference/v1/generate {"token_ids", "features",
  "sampling_params"} with the processed images in `features` (vllm_images.py), answering
  `choices[0].token_ids` and `choices[0].logprobs.content[i].logprob`. The image layout
  (image token id, and tokens per tile or the patch merge size) comes once per server from
  POST /collective_rpc {"method": "asyncrl_image_layout"}. A weight reload clears vLLM's
  cache of image features, so an image is encoded again by the new vision tower.
- POST /pause?mode=abort: every request in flight ends with finish_reason "abort" and the
  tokens it has; new requests wait until /resume. mode=keep freezes them instead.
- POST /collective_rpc {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": folder}}:
  vLLM's `reload_weights` plus re-tying of shared weights (inference/client/vllm_worker.py;
  the server is started with --worker-extension-cls
  asyncrl.inference.client.vllm_worker.WeightSyncExtension).
- POST /update_weight_version {"new_version": "N"}; GET /weight_info -> {"weight_version"}.
- LoRA (a published adapter folder; the server is started with --enable-lora,
  --max-lora-rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, launch/commands.py): POST
  /v1/load_lora_adapter {"lora_name", "lora_path"} between a pause and a resume, then
  /update_weight_version; a completion names the adapter as its "model" (resubmit.py has
  the naming); POST /v1/unload_lora_adapter {"lora_name"} forgets an old one. Both answer
  plain text.
- Broadcast (vLLM's weight-transfer API; the server is started with --weight-transfer-config
  '{"backend": "nccl"}', GPU only): POST /init_weight_transfer_engine {"init_info":
  {"master_address", "master_port", "rank_offset", "world_size", "packed": true,
  "packed_buffer_size_bytes", "packed_num_buffers"}}; per update POST
  /start_weight_update, POST /update_weights {"update_info": {"names", "dtype_names",
  "shapes"}} while the trainer broadcasts (NCCL, packed buckets cut where ours are: the same
  size rule), POST /finish_weight_update {"weight_version": "N"}; POST
  /shutdown_weight_transfer_engine. One worker per server (no TP/DP) is assumed: server k
  is rank 1 + k. vLLM loads the packed buckets into the live model layer by layer as they
  come (its layerwise reload): a broadcast that fails half-way leaves a mix, so the
  client leaves that server paused, out of routing, until the next broadcast rejoins it.
- CUDA IPC (a trainer on the server's GPU; the server is started with
  --weight-transfer-config '{"backend": "ipc"}' and VLLM_ALLOW_INSECURE_SERIALIZATION=1):
  POST /init_weight_transfer_engine {"init_info": {"packed": true}}, /start_weight_update,
  /update_weights {"update_info": {"names", "dtype_names", "shapes", "tensor_sizes",
  "ipc_handles_pickled"}} (`ipc_update_info`: our one shared buffer as vLLM's packed
  chunk; the handle is {GPU UUID: torch's rebuild_cuda_tensor arguments}, pickled and
  base64-encoded, as vLLM's HTTP client sends it), /finish_weight_update {"weight_version"}.
  vLLM's IPC engine copies each tensor out of the buffer before loading it, so the trainer
  may rewrite it once /finish_weight_update has answered. A failure half-way leaves the
  server paused and out of routing, as a broadcast's does. This path needs a GPU: here
  the request bodies are checked against vLLM's own parsing (its
  IPCWeightTransferUpdateInfo and packed-buffer unpacking), not run.
"""

from __future__ import annotations

import base64
import itertools
import pickle
from typing import Any

from asyncrl.api.types import GenerationRequest, StopReason, piece_seed
from asyncrl.inference.client.base import (
    InferenceServerError,
    ServerStatusError,
    WeightBroadcast,
    WeightIpc,
    WeightUpdateError,
)
from asyncrl.inference.client.resubmit import (
    Piece,
    ResubmittingClient,
    Step,
    is_adapter_folder,
)
from asyncrl.inference.client.vllm_images import ImageLayout, image_features, image_layout


class VLLMClient(ResubmittingClient):
    """Routes generations to vLLM servers; a weight update aborts, reloads and resubmits."""

    backend = "vllm"
    serves_images = True  # Idefics3- and Qwen2-VL-like models, through /inference/v1/generate

    def __init__(self, addresses: list[str], **kwargs) -> None:
        super().__init__(addresses, **kwargs)
        self._image_layouts: dict[str, ImageLayout] = {}  # address -> its image layout

    async def _generate_piece(self, address: str, req: GenerationRequest, done_ids: list[int],
                              adapter: str | None) -> Piece:
        if req.images is not None:
            layout = await self._image_layout(address)
            features = image_features(list(req.input_ids), req.images, layout, req.rid)
            body = await self._request(address, "/inference/v1/generate",
                                       generate_body(req, done_ids, features, adapter),
                                       timeout=self.request_timeout)
            return parse_generate(body, address)
        body = await self._request(address, "/v1/completions",
                                   completion_body(req, done_ids, adapter),
                                   timeout=self.request_timeout)
        return parse_completion(body, address)

    async def _image_layout(self, address: str) -> ImageLayout:
        """The image layout of the model `address` serves, asked once; ValueError if vLLM
        takes other image tensors for it."""
        if address not in self._image_layouts:
            body = await self._request(address, "/collective_rpc",
                                       {"method": "asyncrl_image_layout"},
                                       timeout=self.update_weights_timeout)
            try:
                config = body["results"][0]
            except (KeyError, IndexError, TypeError) as e:
                raise InferenceServerError(f"{address}/collective_rpc asyncrl_image_layout: "
                                           f"unexpected answer {str(body)[:300]}") from e
            self._image_layouts[address] = image_layout(config, address)
        return self._image_layouts[address]

    async def _update_one(self, idx: int, path: str | WeightBroadcast, version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        if isinstance(path, (WeightBroadcast, WeightIpc)):
            await self._receive(idx, path, version)
            return
        if is_adapter_folder(path):
            await self._update_adapter(idx, path, version)
            return
        rpc = {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": path}, "timeout": t}
        await self._update_steps(idx, version, [
            ("pause", lambda: self._request(address, "/pause?mode=abort", None, timeout=t)),
            ("reload_weights", lambda: self._request(address, "/collective_rpc", rpc, timeout=t)),
            ("update_weight_version", lambda: self._request(
                address, "/update_weight_version", {"new_version": str(version)}, timeout=t)),
            ("resume", lambda: self._request(address, "/resume", None, timeout=t)),
        ])

    def _adapter_steps(self, idx: int, path: str, version: int, name: str,
                       use: Step) -> list[Step]:
        address, t = self.addresses[idx], self.update_weights_timeout
        load = {"lora_name": name, "lora_path": path}
        return [
            ("pause", lambda: self._request(address, "/pause?mode=abort", None, timeout=t)),
            ("load_lora_adapter", lambda: self._load_adapter(address, load)),
            ("update_weight_version", lambda: self._request(
                address, "/update_weight_version", {"new_version": str(version)}, timeout=t)),
            use,
            ("resume", lambda: self._request(address, "/resume", None, timeout=t)),
        ]

    async def _load_adapter(self, address: str, body: dict[str, Any]) -> None:
        try:
            await self._request(address, "/v1/load_lora_adapter", body,
                                timeout=self.update_weights_timeout, text=True)
        except ServerStatusError as e:
            if e.status == 404 and "Not Found" in str(e):  # the route itself is missing
                raise ServerStatusError(
                    f"{e}: this vLLM server does not load LoRA adapters; start it with "
                    "--enable-lora --max-lora-rank <r> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                    "(a run with actor.use_lora=true does)", e.status) from e
            raise

    async def _unload_adapter(self, address: str, name: str) -> None:
        await self._request(address, "/v1/unload_lora_adapter", {"lora_name": name},
                            timeout=self.update_weights_timeout, text=True)

    async def _receive(self, idx: int, update: WeightBroadcast | WeightIpc,
                       version: int) -> None:
        """Receive a broadcast, or copy the trainer's shared buffer, through vLLM's
        weight-transfer routes between a pause and a resume."""
        address, t = self.addresses[idx], self.update_weights_timeout
        how = "the broadcast" if isinstance(update, WeightBroadcast) else "the CUDA IPC buffer"
        if isinstance(update, WeightIpc):
            try:  # before the pause: a bad body leaves the server serving
                info = ipc_update_info(update)
            except ValueError as e:
                raise WeightUpdateError(f"weight update to version {version} on {address}: "
                                        f"{e}") from e
        else:
            info = update_info(update)

        def post(route: str, body: dict[str, Any] | None = None):
            return lambda: self._request(address, route, body, timeout=t)

        await self._update_steps(idx, version, [("pause", post("/pause?mode=abort"))])
        try:
            if isinstance(update, WeightIpc):  # the importer decodes as packed
                await post("/init_weight_transfer_engine", {"init_info": {"packed": True}})()
            await post("/start_weight_update")()
            await post("/update_weights", {"update_info": info})()
            await post("/finish_weight_update", {"weight_version": str(version)})()
        except InferenceServerError as e:
            self._mark_down(idx, f"weights partly updated by a failed transfer: {e}")
            raise WeightUpdateError(f"weight update to version {version} failed on {address} "
                                    f"while receiving {how} (left paused: its weights are "
                                    f"partly updated): {e}") from e
        await self._update_steps(idx, version, [("resume", post("/resume"))])

    def _join_request(self, rank: int, world_size: int, master_address: str, master_port: int,
                      group_name: str, backend: str, bucket_bytes: int) -> tuple[str, dict]:
        return "/init_weight_transfer_engine", {"init_info": {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank,
            "world_size": world_size, "packed": True, "packed_buffer_size_bytes": bucket_bytes,
            "packed_num_buffers": 2}}

    def _leave_request(self, group_name: str) -> tuple[str, dict | None]:
        return "/shutdown_weight_transfer_engine", None

    async def _read_version(self, address: str) -> int:
        body = await self._request(address, "/weight_info", None,
                                   timeout=self.update_weights_timeout, method="GET")
        label = body.get("weight_version")
        # A server that has loaded nothing since start-up says "default" (the base model).
        return 0 if label in (None, "default") else int(label)

    async def _pause_one(self, address: str) -> Any:
        # keep: requests in flight are frozen, not aborted (the protocol's pause)
        return await self._request(address, "/pause?mode=keep", None,
                                   timeout=self.update_weights_timeout)

    async def _resume_one(self, address: str) -> Any:
        return await self._request(address, "/resume", None, timeout=self.update_weights_timeout)


def update_info(broadcast: WeightBroadcast) -> dict[str, Any]:
    """vLLM's NCCL update info: the tensors in order (it cuts the buckets itself)."""
    layout = broadcast.layout
    return {"names": list(layout["names"]), "dtype_names": list(layout["dtypes"]),
            "shapes": [list(s) for s in layout["shapes"]]}


def ipc_update_info(update: WeightIpc) -> dict[str, Any]:
    """vLLM's packed IPC update info for our IPC body (weights/ipc.py): one chunk, the
    tensors end to end from the buffer's first byte (vLLM splits it by `tensor_sizes`), and
    the handle as {GPU UUID: rebuild_cuda_tensor's arguments}, pickled and base64-encoded
    (`ipc_handles_pickled`, the form vLLM's HTTP route decodes). ValueError if not."""
    from asyncrl.weights.ipc import parse_update  # torch: only where weights move
    from asyncrl.weights.transport import DTYPES

    layout, handle = parse_update(update.body)
    sizes = [layout.nbytes(i) for i in range(len(layout.names))]
    if list(layout.offsets) != list(itertools.accumulate(sizes[:-1], initial=0)):
        raise ValueError("vLLM reads the tensors of a packed IPC buffer end to end from byte "
                         "0, but this layout's offsets leave gaps")
    for name, offset, dtype in zip(layout.names, layout.offsets, layout.dtypes):
        if offset % DTYPES[dtype].itemsize:  # vLLM views each tensor in place
            raise ValueError(f"{name} ({dtype}) starts at byte {offset}, which vLLM cannot "
                             "view as its dtype; send the weights in one dtype")
    pickled = pickle.dumps({handle.gpu_uuid: handle.rebuild_args()})
    return {"names": list(layout.names), "dtype_names": list(layout.dtypes),
            "shapes": [list(s) for s in layout.shapes], "tensor_sizes": sizes,
            "ipc_handles_pickled": base64.b64encode(pickled).decode()}


def completion_body(req: GenerationRequest, done_ids: list[int],
                    adapter: str | None = None) -> dict[str, Any]:
    """The /v1/completions request continuing `req` after the `done_ids` already sampled,
    under the LoRA adapter named `adapter` (None: the served model)."""
    return {
        **({"model": adapter} if adapter is not None else {}),
        "prompt": list(req.input_ids) + list(done_ids),
        **sampling_fields(req, done_ids),
        "return_token_ids": True,
    }


def generate_body(req: GenerationRequest, done_ids: list[int], features: dict[str, Any],
                  adapter: str | None = None) -> dict[str, Any]:
    """The /inference/v1/generate request continuing `req` (a prompt with images, whose
    processed tensors are `features`: vllm_images.py) after the `done_ids` already sampled.
    The images' placeholders keep their offsets: the sampled tokens come after them."""
    return {
        **({"model": adapter} if adapter is not None else {}),
        "token_ids": list(req.input_ids) + list(done_ids),
        "features": features,
        "sampling_params": sampling_fields(req, done_ids),
    }


def sampling_fields(req: GenerationRequest, done_ids: list[int]) -> dict[str, Any]:
    """vLLM's sampling parameters for what is left of `req` after `done_ids`."""
    s = req.sampling
    return {
        "max_tokens": s.max_new_tokens - len(done_ids),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,  # 0 disables it, as ours
        "stop_token_ids": list(s.stop_token_ids),
        "stop": list(s.stop),
        "ignore_eos": s.ignore_eos,
        **({"seed": piece_seed(s.seed, len(done_ids))} if s.seed is not None else {}),
        "logprobs": 0,  # the sampled token's log-prob only
        "skip_special_tokens": False,
    }


def parse_completion(body: dict[str, Any], address: str) -> Piece:
    """Token ids, their log-probs and the finish reason of a /v1/completions answer."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        finish = StopReason(choice["finish_reason"])  # stop | length | abort
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InferenceServerError(f"{address}/v1/completions: unexpected answer "
                                   f"({type(e).__name__}: {e}): {str(body)[:300]}") from e
    if len(lps) != len(ids):
        raise InferenceServerError(f"{address}/v1/completions: {len(ids)} token ids but "
                                   f"{len(lps)} log-probs")
    return Piece(ids, [float(x) for x in lps], finish)


def parse_generate(body: dict[str, Any], address: str) -> Piece:
    """Token ids, their log-probs and the finish reason of an /inference/v1/generate answer."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = [float(x["logprob"]) for x in (choice.get("logprobs") or {}).get("content") or []]
        finish = StopReason(choice["finish_reason"])  # stop | length | abort
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InferenceServerError(f"{address}/inference/v1/generate: unexpected answer "
                                   f"({type(e).__name__}: {e}): {str(body)[:300]}") from e
    if len(lps) != len(ids):
        raise InferenceServerError(f"{address}/inference/v1/generate: {len(ids)} token ids but "
                                   f"{len(lps)} log-probs")
    return Piece(ids, lps, finish)
