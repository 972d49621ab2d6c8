"""Client for SGLang's native HTTP API (sglang.launch_server).

Endpoints used (shapes from SGLang's http_server.py and io_struct.py):
- POST /generate {"input_ids", "sampling_params", "return_logprob": true, "rid"}: the answer's
  meta_info.output_token_logprobs holds one [logprob, token_id, text] triple per sampled
  token; meta_info.finish_reason is {"type": "stop" | "length" | "abort", ...}.
- POST /pause_generation {"mode": "abort"}: requests in flight end with finish_reason
  "abort" and their tokens so far (as vLLM's /pause); POST /continue_generation resumes.
- POST /update_weights_from_disk {"model_path", "weight_version"} -> {"success", "message"}.
- LoRA (a published adapter folder; the server is started with --enable-lora,
  --max-lora-rank and --lora-target-modules, launch/commands.py): POST /load_lora_adapter
  {"lora_name", "lora_path"} -> {"success", "error_message", "loaded_adapters"} between a
  pause and a resume, then POST /update_weight_version {"new_version"}; /generate names the
  adapter in "lora_path" (resubmit.py has the naming); POST /unload_lora_adapter
  {"lora_name"} forgets an old one.
- Routed experts (MoE routing replay; the server is started with
  --enable-return-routed-experts, controller/launch.py): /generate with
  "return_routed_experts": true answers meta_info.routed_experts, the base64 of an int32
  array of shape [input + output tokens - 1, MoE layers, top_k] (C order): the experts each
  layer chose for every token the server ran, the last sampled token excepted (SGLang PR
  #12162: tokenizer_manager.py encodes the tensor's bytes; its docs give the shape).
- A prompt with images: /generate also gets "image_data": [{"format": "processor_output",
  "pixel_values", "pixel_attention_mask"}], the image part of the HF processor's output
  for the prompt (batch of one, as the processor returns it; tensors as nested JSON
  lists), beside the prompt's "input_ids" as our processor made them. This is SGLang's
  documented input for processed images ("Processor Output" in its VLM query guide): its
  processor then takes the tensors as they are and finds the image tokens in the ids
  instead of expanding a placeholder. The body is tested here, not a live server (SGLang
  does not run on these CPUs); the served model needs an SGLang multimodal processor
  that takes processor_output items.
- GET /model_info -> {"weight_version", ...}; GET /health. SGLang 0.5.6 added /model_info
  and deprecated /get_model_info (it logs a warning per call); servers up to 0.5.5 have only
  /get_model_info, which the client then asks instead (after one 404 per server).
- Broadcast: POST /init_weights_update_group {"master_address", "master_port",
  "rank_offset", "world_size", "group_name", "backend"}; then per bucket POST
  /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
  "load_format": "flattened_bucket", "flush_cache", "weight_version"} while the trainer
  broadcasts that bucket; POST /destroy_weights_update_group {"group_name"}.

SGLang loads each bucket into the live model as it comes: a broadcast that fails half-way
leaves a server with a mix of old and new weights under its old version. The client then
leaves it paused (out of routing) rather than resuming it; it rejoins, and gets whole
weights, with the next broadcast.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from asyncrl.api.types import GenerationRequest, ImageInputs, StopReason, piece_seed
from asyncrl.inference.client.base import (
    InferenceServerError,
    ServerStatusError,
    WeightBroadcast,
    WeightUpdateError,
)
from asyncrl.inference.client.resubmit import (
    Piece,
    ResubmittingClient,
    Step,
    is_adapter_folder,
)


class SGLangClient(ResubmittingClient):
    """Routes generations to SGLang servers; a weight update aborts, reloads and resubmits."""

    backend = "sglang"
    serves_images = True  # as processor output beside the token ids (module doc)

    def __init__(self, addresses: list[str], *, moe_routes: tuple[int, int] | None = None,
                 **kwargs) -> None:
        """`moe_routes`: (MoE layers, top_k) of the served model, to ask every generation
        for its routed experts (`moe_route_shape`); None: not asked."""
        super().__init__(addresses, **kwargs)
        self.moe_routes = moe_routes
        self._old_model_info: set[str] = set()  # servers without /model_info (<= 0.5.5)

    async def _generate_piece(self, address: str, req: GenerationRequest, done_ids: list[int],
                              adapter: str | None) -> Piece:
        request = generate_body(req, done_ids, adapter, routes=self.moe_routes is not None)
        body = await self._request(address, "/generate", request, timeout=self.request_timeout)
        piece = parse_generate(body, address)
        # An aborted piece may come without them; the last piece's cover every token.
        recorded = "routed_experts" in body.get("meta_info", {})
        if self.moe_routes is not None and (recorded or piece.finish != StopReason.ABORT):
            ran = len(request["input_ids"]) + len(piece.output_ids) - 1
            piece.routed_experts = parse_routes(body, address, ran, self.moe_routes)
        return piece

    async def _update_one(self, idx: int, path: str | WeightBroadcast, version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        pause = ("pause_generation", lambda: self._request(
            address, "/pause_generation", {"mode": "abort"}, timeout=t))
        resume = ("continue_generation", lambda: self._request(
            address, "/continue_generation", {}, timeout=t))
        if not isinstance(path, WeightBroadcast) and is_adapter_folder(path):
            await self._update_adapter(idx, path, version)
            return
        if not isinstance(path, WeightBroadcast):
            load = {"model_path": path, "weight_version": str(version)}
            await self._update_steps(idx, version, [pause, (
                "update_weights_from_disk",
                lambda: self._load(address, "/update_weights_from_disk", load, t)), resume])
            return
        buckets = bucket_bodies(path, version)
        await self._update_steps(idx, version, [pause])
        try:
            for body in buckets:
                await self._load(address, "/update_weights_from_distributed", body, t)
        except InferenceServerError as e:
            self._mark_down(idx, f"weights partly updated by a failed broadcast: {e}")
            raise WeightUpdateError(f"weight update to version {version} failed on {address} "
                                    f"at step 'update_weights_from_distributed' (left paused: "
                                    f"its weights are partly updated): {e}") from e
        await self._update_steps(idx, version, [resume])

    def _adapter_steps(self, idx: int, path: str, version: int, name: str,
                       use: Step) -> list[Step]:
        address, t = self.addresses[idx], self.update_weights_timeout
        load = {"lora_name": name, "lora_path": path}
        return [
            ("pause_generation", lambda: self._request(
                address, "/pause_generation", {"mode": "abort"}, timeout=t)),
            ("load_lora_adapter", lambda: self._load(address, "/load_lora_adapter", load, t)),
            ("update_weight_version", lambda: self._load(
                address, "/update_weight_version", {"new_version": str(version)}, t)),
            use,
            ("continue_generation", lambda: self._request(
                address, "/continue_generation", {}, timeout=t)),
        ]

    async def _unload_adapter(self, address: str, name: str) -> None:
        await self._load(address, "/unload_lora_adapter", {"lora_name": name},
                         self.update_weights_timeout)

    async def _load(self, address: str, route: str, load: dict[str, Any], timeout: float) -> None:
        body = await self._request(address, route, load, timeout=timeout)
        if not body.get("success", False):  # older servers answer 200 with success=false
            why = body.get("message") or body.get("error_message") or body
            raise InferenceServerError(f"{address}{route}: {why}")

    def _join_request(self, rank: int, world_size: int, master_address: str, master_port: int,
                      group_name: str, backend: str, bucket_bytes: int) -> tuple[str, dict]:
        return "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank,
            "world_size": world_size, "group_name": group_name, "backend": backend}

    def _leave_request(self, group_name: str) -> tuple[str, dict | None]:
        return "/destroy_weights_update_group", {"group_name": group_name}

    async def _read_version(self, address: str) -> int:
        body = await self._model_info(address)
        label = body.get("weight_version")
        return 0 if label in (None, "default") else int(label)

    async def _model_info(self, address: str) -> dict[str, Any]:
        """The server's model info: /model_info, or /get_model_info where that is a 404."""
        t = self.update_weights_timeout
        if address not in self._old_model_info:
            try:
                return await self._request(address, "/model_info", None, timeout=t, method="GET")
            except ServerStatusError as e:
                if e.status != 404:
                    raise
            self._old_model_info.add(address)
        return await self._request(address, "/get_model_info", None, timeout=t, method="GET")

    async def _pause_one(self, address: str) -> Any:
        # retract: requests in flight go back to the queue, kept (the protocol's pause)
        return await self._request(address, "/pause_generation", {"mode": "retract"},
                                   timeout=self.update_weights_timeout)

    async def _resume_one(self, address: str) -> Any:
        return await self._request(address, "/continue_generation", {},
                                   timeout=self.update_weights_timeout)


def bucket_bodies(broadcast: WeightBroadcast, version: int) -> list[dict[str, Any]]:
    """One /update_weights_from_distributed body per bucket of the broadcast, in order; the
    last sets the version and flushes the cache."""
    layout, bodies, first = broadcast.layout, [], 0
    for k, count in enumerate(layout["buckets"]):
        last = k == len(layout["buckets"]) - 1
        part = slice(first, first + count)
        bodies.append({"names": layout["names"][part], "dtypes": layout["dtypes"][part],
                       "shapes": layout["shapes"][part], "group_name": broadcast.group_name,
                       "load_format": "flattened_bucket", "flush_cache": last,
                       **({"weight_version": str(version)} if last else {})})
        first += count
    return bodies


def generate_body(req: GenerationRequest, done_ids: list[int],
                  adapter: str | None = None, routes: bool = False) -> dict[str, Any]:
    """The /generate request continuing `req` after the `done_ids` already sampled, under
    the LoRA adapter named `adapter` (None: the base model), asking for the routed experts
    if `routes`; a prompt's images go as processor output (module doc)."""
    s = req.sampling
    return {
        **({"lora_path": adapter} if adapter is not None else {}),
        **({"return_routed_experts": True} if routes else {}),
        **({"image_data": [processor_output(req.images)]} if req.images is not None else {}),
        "input_ids": list(req.input_ids) + list(done_ids),
        "sampling_params": {
            "max_new_tokens": s.max_new_tokens - len(done_ids),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang disables top-k with -1
            "stop_token_ids": list(s.stop_token_ids),
            "stop": list(s.stop),
            "ignore_eos": s.ignore_eos,
            "skip_special_tokens": False,
            **({"sampling_seed": piece_seed(s.seed, len(done_ids))} if s.seed is not None
               else {}),
        },
        "return_logprob": True,
        # one rid per piece: SGLang refuses a rid that is still known to it
        "rid": f"{req.rid}-{len(done_ids)}",
    }


def processor_output(images: ImageInputs) -> dict[str, Any]:
    """A prompt's images as SGLang's "processor_output" item: the HF processor's image
    tensors for a batch of one prompt, as nested lists (Qwen2-VL's family: the patches and
    image_grid_thw, unbatched, as its processor returns them)."""
    if images.image_grid_thw is not None:
        return {"format": "processor_output", "pixel_values": images.pixel_values.tolist(),
                "image_grid_thw": images.image_grid_thw.tolist()}
    mask = images.pixel_attention_mask
    if mask is None:
        mask = torch.ones(images.n_items, *images.pixel_values.shape[2:], dtype=torch.bool)
    return {"format": "processor_output", "pixel_values": [images.pixel_values.tolist()],
            "pixel_attention_mask": [mask.tolist()]}


def parse_generate(body: dict[str, Any], address: str) -> Piece:
    """Token ids, their log-probs and the finish reason of a /generate answer."""
    try:
        meta = body["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        finish = StopReason(meta["finish_reason"]["type"])  # stop | length | abort
        ids = [int(t[1]) for t in triples]
        lps = [float(t[0]) for t in triples]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InferenceServerError(f"{address}/generate: unexpected answer "
                                   f"({type(e).__name__}: {e}): {str(body)[:300]}") from e
    if "output_ids" in body and list(body["output_ids"]) != ids:
        raise InferenceServerError(f"{address}/generate: output_ids {body['output_ids'][:8]}... "
                                   f"differ from the log-prob tokens {ids[:8]}...")
    return Piece(ids, lps, finish)


def parse_routes(body: dict[str, Any], address: str, n_tokens: int,
                 shape: tuple[int, int]) -> torch.Tensor:
    """meta_info.routed_experts of a /generate answer as int16 [n_tokens, layers, top_k]
    (`shape`: layers, top_k); InferenceServerError naming the server if it is missing or
    of another size."""
    encoded = body.get("meta_info", {}).get("routed_experts")
    if not isinstance(encoded, str):
        raise InferenceServerError(
            f"{address}/generate: no meta_info.routed_experts in the answer, asked for by "
            "actor.routing_replay=true; start SGLang with --enable-return-routed-experts")
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    layers, k = shape
    if flat.size != n_tokens * layers * k:
        raise InferenceServerError(
            f"{address}/generate: routed_experts holds {flat.size} expert ids, not "
            f"{n_tokens} tokens x {layers} MoE layers x top {k}: does the server run "
            "actor.path's model?")
    return torch.from_numpy(flat.astype(np.int16)).view(n_tokens, layers, k)


def moe_route_shape(config: dict[str, Any]) -> tuple[int, int]:
    """(MoE layers, top_k) of an HF config.json whose every decoder layer is MoE (SGLang
    reports one row of experts per layer); ValueError otherwise."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    k = config.get("num_experts_per_tok") or 0
    layers = config["num_hidden_layers"]
    dense = [i for i in range(layers) if i in (config.get("mlp_only_layers") or [])
             or (i + 1) % (config.get("decoder_sparse_step") or 1)]
    if not experts or not k or dense:
        raise ValueError(
            f"actor.routing_replay=true with SGLang needs a model whose every layer is MoE; "
            f"{config.get('model_type')!r} has "
            + (f"dense layers {dense}" if experts and k else "no experts")
            + "; set actor.routing_replay=false")
    return layers, k
