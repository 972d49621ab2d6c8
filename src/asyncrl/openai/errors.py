"""The error every /v1 route answers with, in OpenAI's shape (Anthropic's route rewraps it)."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


class ContextLengthError(OpenAIError):
    """A prompt of `tokens` tokens that a context of `limit` tokens cannot answer."""

    def __init__(self, message: str, *, tokens: int, limit: int, param: str):
        super().__init__(message, param=param, code="context_length_exceeded")
        self.tokens, self.limit = tokens, limit
