"""OpenAI-compatible gateway in front of any inference server we have a client for.

    python -m asyncrl.inference.gateway --backend-url http://127.0.0.1:8000 --port 9000

It tokenizes here (chat template, tool prompts), asks the backend for token ids through
an `InferenceEngine` client, and answers in OpenAI's shapes with our extension fields
(see openai_api.py). The backend client is built in one place, `make_engine`; a client
without token streaming is streamed as the finished answer replayed in chunks. The API
key ($ASYNCRL_API_KEY) guards the gateway and is sent to the backend.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from asyncrl.api.http import serve_app
from asyncrl.inference.client.backends import client_class
from asyncrl.models.hub import resolve_model_path
from asyncrl.openai.routes import openai_app

BACKENDS = ("local", "vllm", "sglang")


def make_engine(backend: str, url: str, api_key: str | None) -> Any:
    """The `InferenceEngine` client of `backend` at `url`."""
    return client_class(backend)([url], api_key=api_key)


async def backend_model(engine: Any) -> str:
    """The model our local server reports in /health (what to load the tokenizer from)."""
    return (await engine.health())[0]["model"]


def load_tokenizer(name_or_path: str) -> Any:
    """An HF tokenizer from a folder, hub id or named model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


async def run_gateway(engine: Any, tokenizer: Any, *, model_name: str, host: str, port: int,
                      api_key: str | None, max_model_len: int | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """Serve the /v1 routes until SIGTERM/SIGINT (or `stop` is set)."""
    app = openai_app(engine, tokenizer, model_name, api_key=api_key, max_model_len=max_model_len)
    try:
        await serve_app(app, host=host, port=port, banner="asyncrl openai gateway", stop=stop)
    finally:
        await engine.close()


async def serve(backend: str, url: str, *, tokenizer: str | None, model_name: str | None,
                host: str, port: int, max_model_len: int | None = None,
                startup_timeout: float = 60.0) -> None:
    """Wait for the backend at `url`, then serve the /v1 routes in front of it until signalled."""
    api_key = os.environ.get("ASYNCRL_API_KEY") or None
    engine = make_engine(backend, url, api_key)
    await engine.wait_healthy(timeout=startup_timeout)
    if tokenizer is None:
        if backend != "local":
            raise SystemExit(f"--tokenizer is needed with --backend {backend} (only our local "
                             "server reports its model)")
        tokenizer = await backend_model(engine)
    await run_gateway(engine, load_tokenizer(tokenizer), model_name=model_name or tokenizer,
                      host=host, port=port, api_key=api_key, max_model_len=max_model_len)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m asyncrl.inference.gateway`."""
    p = argparse.ArgumentParser(prog="python -m asyncrl.inference.gateway",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend-url", required=True, help="the inference server, http://HOST:PORT")
    p.add_argument("--backend", default="local", choices=BACKENDS)
    p.add_argument("--tokenizer", default=None,
                   help="HF folder, hub id or named model (default: the model the backend serves)")
    p.add_argument("--model-name", default=None, help="the served model name (default: tokenizer)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length; longer prompts get a 400 here rather than a backend error")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000, help="0 picks a free port (printed on start)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; the API key comes from $ASYNCRL_API_KEY."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    asyncio.run(serve(args.backend, args.backend_url, tokenizer=args.tokenizer,
                      model_name=args.model_name, host=args.host, port=args.port,
                      max_model_len=args.max_model_len))


if __name__ == "__main__":
    main()
