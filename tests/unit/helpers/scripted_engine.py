"""An engine that answers each request with a scripted reply, for proxy tests."""

from __future__ import annotations

import asyncio

from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason


class ScriptedEngine:
    """Answers request i with replies[i]'s tokens (+ EOS); log-prob of token j is -0.01 * j."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.calls: list[GenerationRequest] = []
        self.version = 0

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        self.calls.append(req)
        text = self.replies[min(len(self.calls), len(self.replies)) - 1]
        ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        await asyncio.sleep(0.01)
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.01 * j for j in range(len(ids))],
                                  output_versions=[self.version] * len(ids),
                                  stop_reason=StopReason.STOP)
