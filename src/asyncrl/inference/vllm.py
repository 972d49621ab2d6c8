"""Client for vLLM's OpenAI-compatible server (vLLM >= 0.32, CPU or GPU build).

Endpoints used (the server needs VLLM_SERVER_DEV_MODE=1 for /collective_rpc):
- POST /v1/completions with a token-id prompt, `logprobs: 0` and `return_token_ids: true`:
  `choices[0].token_ids` and `choices[0].logprobs.token_logprobs` are the sampled tokens and
  their log-probs (the server runs with --logprobs-mode processed_logprobs, so they are
  log_softmax(logits / T), as the trainer recomputes them).
- POST /pause?mode=abort: every request in flight ends with finish_reason "abort" and the
  tokens it has; new requests wait until /resume. mode=keep freezes them instead.
- POST /collective_rpc {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": folder}}:
  vLLM's `reload_weights` plus re-tying of shared weights (vllm_worker.py; the server is
  started with --worker-extension-cls asyncrl.inference.vllm_worker.WeightSyncExtension).
- POST /update_weight_version {"new_version": "N"}; GET /weight_info -> {"weight_version"}.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.types import GenerationRequest, StopReason
from asyncrl.inference.base import InferenceServerError
from asyncrl.inference.resubmit import Piece, ResubmittingEngine


class VLLMInferenceEngine(ResubmittingEngine):
    """Routes generations to vLLM servers; a weight update aborts, reloads and resubmits."""

    backend = "vllm"

    async def _generate_piece(self, address: str, req: GenerationRequest,
                              done_ids: list[int]) -> Piece:
        body = await self._request(address, "/v1/completions", completion_body(req, done_ids),
                                   timeout=self.request_timeout)
        return parse_completion(body, address)

    async def _update_one(self, idx: int, path: str, version: int) -> None:
        address, t = self.addresses[idx], self.update_weights_timeout
        rpc = {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": path}, "timeout": t}
        await self._update_steps(idx, version, [
            ("pause", lambda: self._request(address, "/pause?mode=abort", None, timeout=t)),
            ("reload_weights", lambda: self._request(address, "/collective_rpc", rpc, timeout=t)),
            ("update_weight_version", lambda: self._request(
                address, "/update_weight_version", {"new_version": str(version)}, timeout=t)),
            ("resume", lambda: self._request(address, "/resume", None, timeout=t)),
        ])

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


def completion_body(req: GenerationRequest, done_ids: list[int]) -> dict[str, Any]:
    """The /v1/completions request continuing `req` after the `done_ids` already sampled."""
    s = req.sampling
    return {
        "prompt": list(req.input_ids) + list(done_ids),
        "max_tokens": s.max_new_tokens - len(done_ids),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,  # 0 disables it, as ours
        "stop_token_ids": list(s.stop_token_ids),
        "stop": list(s.stop),
        "ignore_eos": s.ignore_eos,
        "logprobs": 0,  # the sampled token's log-prob only
        "return_token_ids": True,
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
