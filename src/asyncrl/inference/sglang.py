"""Client for SGLang's native HTTP API (sglang.launch_server).

Endpoints used (shapes from SGLang's http_server.py and io_struct.py):
- POST /generate {"input_ids", "sampling_params", "return_logprob": true, "rid"}: the answer's
  meta_info.output_token_logprobs holds one [logprob, token_id, text] triple per sampled
  token; meta_info.finish_reason is {"type": "stop" | "length" | "abort", ...}.
- POST /pause_generation {"mode": "abort"}: requests in flight end with finish_reason
  "abort" and their tokens so far (as vLLM's /pause); POST /continue_generation resumes.
- POST /update_weights_from_disk {"model_path", "weight_version"} -> {"success", "message"}.
- GET /get_model_info -> {"weight_version", ...}; GET /health.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.types import GenerationRequest, StopReason
from asyncrl.inference.base import InferenceServerError
from asyncrl.inference.resubmit import Piece, ResubmittingEngine


class SGLangInferenceEngine(ResubmittingEngine):
    """Routes generations to SGLang servers; a weight update aborts, reloads and resubmits."""

    backend = "sglang"

    async def _generate_piece(self, address: str, req: GenerationRequest,
                              done_ids: list[int]) -> Piece:
        body = await self._request(address, "/generate", generate_body(req, done_ids),
                                   timeout=self.request_timeout)
        return parse_generate(body, address)

    async def _update_one(self, idx: int, path: str, version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        load = {"model_path": path, "weight_version": str(version)}
        await self._update_steps(idx, version, [
            ("pause_generation", lambda: self._request(
                address, "/pause_generation", {"mode": "abort"}, timeout=t)),
            ("update_weights_from_disk", lambda: self._load(address, load, t)),
            ("continue_generation", lambda: self._request(
                address, "/continue_generation", {}, timeout=t)),
        ])

    async def _load(self, address: str, load: dict[str, Any], timeout: float) -> None:
        body = await self._request(address, "/update_weights_from_disk", load, timeout=timeout)
        if not body.get("success", False):  # older servers answer 200 with success=false
            raise InferenceServerError(f"{address}/update_weights_from_disk: "
                                       f"{body.get('message', body)}")

    async def _read_version(self, address: str) -> int:
        body = await self._request(address, "/get_model_info", None,
                                   timeout=self.update_weights_timeout, method="GET")
        label = body.get("weight_version")
        return 0 if label in (None, "default") else int(label)

    async def _pause_one(self, address: str) -> Any:
        # retract: requests in flight go back to the queue, kept (the protocol's pause)
        return await self._request(address, "/pause_generation", {"mode": "retract"},
                                   timeout=self.update_weights_timeout)

    async def _resume_one(self, address: str) -> Any:
        return await self._request(address, "/continue_generation", {},
                                   timeout=self.update_weights_timeout)


def generate_body(req: GenerationRequest, done_ids: list[int]) -> dict[str, Any]:
    """The /generate request continuing `req` after the `done_ids` already sampled."""
    s = req.sampling
    return {
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
        },
        "return_logprob": True,
        # one rid per piece: SGLang refuses a rid that is still known to it
        "rid": f"{req.rid}-{len(done_ids)}",
    }


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
