"""OpenAI-compatible HTTP routes over any engine with `agenerate` and a tokenizer.

    GET /v1/models, /v1/models/{model}, POST /v1/completions, /v1/chat/completions (SSE)
    POST /v1/responses, /v1/messages, /v1/messages/count_tokens (answered over chat)
    GET|HEAD /  (200: the base URL answers)

The engine is anything with `async agenerate(GenerationRequest) -> GenerationResponse`
(the `InferenceEngine` protocol: our local engine, `LocalServerClient`, vLLM/SGLang
clients). If it also has `astream(req)` (an async iterator of `StreamedToken`, then the
final `GenerationResponse`), streamed answers go out token by token; otherwise a stream
is the finished answer replayed as chunks.

Extension fields, so agent workflows can record exactly what was sampled. On every choice
(and on every stream chunk's choice, for the tokens of that chunk):
    prompt_token_ids  the prompt's token ids (non-streamed, and a stream's first chunk)
    token_ids         the completion's sampled token ids
    token_logprobs    their log-probs under the sampling weights
    token_versions    the weight version that sampled each token
`token_ids` are all the tokens sampled, so they may go past `text`: a final EOS token, and
a stop string (which OpenAI's text leaves out) are in `token_ids` but not in `text`.
Standard `logprobs` cover the same tokens. Top-k alternatives (completions `logprobs: k`:
a {token: logprob} dict per token, the sampled token included as vLLM does; chat
`top_logprobs: k`: `content[i].top_logprobs`) and completions `echo` (the prompt's tokens
and log-probs first, the first token's null; `max_tokens: 0` for the prompt alone, as
lm-evaluation-harness asks) need an engine with `serves_top_logprobs` and `ascore` (our
own); other engines answer them with a 400.

Tool calls: see `tool_calls.py`. They are read in the chat template's own format (Hermes
`<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`; `tool_parser` names one instead), from
text that keeps the format's special marker tokens. A parsed call ends the choice with
finish_reason "tool_calls" (unless it hit the token limit: "length"). Streamed, text before
the first call goes out as it is made; the calls go out in the last chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from aiohttp import web

from asyncrl.api import openapi
from asyncrl.api.errors import InferenceError
from asyncrl.api.http import PUBLIC_PATHS, key_matches
from asyncrl.api.types import (
    GenerationRequest,
    GenerationResponse,
    StopReason,
    mix_seed,
)
from asyncrl.openai.anthropic import AnthropicRoutes
from asyncrl.openai.detokenize import (
    IncrementalDetokenizer,
    detokenize,
    token_bytes,
    token_string,
)
from asyncrl.openai.images import ImagePrompts
from asyncrl.openai.protocol import (
    Job,
    OpenAIError,
    parse_chat,
    parse_completion,
    template_renders_tools,
)
from asyncrl.openai.responses import ResponsesRoutes
from asyncrl.openai.tool_calls import HERMES, ToolCallHold, tool_format


class StreamedToken(NamedTuple):
    """One sampled token, as an engine's `astream` yields it."""

    id: int
    logprob: float
    version: int


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Method = Callable[..., Awaitable[web.StreamResponse]]


def _answers_errors(method: Method) -> Method:
    """Turn OpenAIError and engine failures into OpenAI-shaped error responses."""
    @functools.wraps(method)
    async def wrapped(self: Any, request: web.Request, *args: Any) -> web.StreamResponse:
        try:
            return await method(self, request, *args)
        except OpenAIError as e:
            return web.json_response(e.body(), status=e.status)
        except InferenceError as e:  # a backend server failed or answered an error
            err = OpenAIError(f"the inference backend failed: {e}", status=502,
                              type="server_error")
            return web.json_response(err.body(), status=502)
        except RuntimeError as e:  # the local engine shut down or a step failed
            err = OpenAIError(f"generation failed: {e}", status=503, type="server_error")
            return web.json_response(err.body(), status=503)
    return wrapped


async def root(request: web.Request) -> web.Response:
    """GET or HEAD / : 200, for clients that check the base URL answers (Claude Code's HEAD)."""
    return web.json_response({"ok": True})


def openai_auth(api_key: str | None):
    """Middleware: 401 in OpenAI's shape unless `Authorization: Bearer <api_key>`."""
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and request.path not in PUBLIC_PATHS and not key_matches(request, api_key):
            return unauthorized()
        return await handler(request)
    return auth


def unauthorized() -> web.Response:
    """The 401 answer, in OpenAI's error shape."""
    err = OpenAIError("missing or wrong API key (Authorization: Bearer <key>)", status=401,
                      code="invalid_api_key")
    return web.json_response(err.body(), status=401)


class OpenAIRoutes:
    """The /v1 routes of one served model."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *,
                 max_model_len: int | None = None, tool_parser: str | None = None,
                 images: ImagePrompts | None = None):
        """`images`: the processor of a model that reads images (`load_image_prompts`);
        None: image parts and blocks are refused (the model reads text only)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.images = images
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.native_tools = template_renders_tools(tokenizer)
        # Unnamed, the format is the template's; a template that cannot render tools gets
        # our Hermes system block, so the model is taught (and read) the Hermes form.
        self.tool_format = tool_format(tokenizer, tool_parser) \
            if tool_parser is not None or self.native_tools else HERMES
        self.tool_marker_ids = self.tool_format.special_ids(tokenizer)
        self.created = int(time.time())

    def add_to(self, app: web.Application) -> None:
        """Mount the routes on `app`: chat, completions, and Responses and Messages over chat."""
        app.add_routes([web.get("/", root),
                        web.get("/v1/models", self.models),
                        web.get("/v1/models/{model}", self.model),
                        web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions)])
        ResponsesRoutes(self._chat_fn, self.model_name).add_to(app)
        AnthropicRoutes(self._chat_fn, self.model_name, self._count_fn,
                        reads_images=self.images is not None).add_to(app)

    async def _chat_fn(self, request: web.Request, body: dict) -> dict:
        return await self.chat_json(body)

    async def _count_fn(self, request: web.Request, body: dict) -> int:
        return self.prompt_length(body)

    def card(self, name: str) -> dict[str, Any]:
        """The model object OpenAI's /v1/models answers with, for the served model."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "asyncrl",
                "max_model_len": self.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.card(self.model_name)]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the served model's card; any other name is OpenAI's 404."""
        name = request.match_info["model"]
        if name != self.model_name:
            error = OpenAIError(f"The model '{name}' does not exist", status=404,
                                param="model", code="model_not_found")
            return web.json_response(error.body(), status=404)
        return web.json_response(self.card(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer_completion(request, await _json_or_none(request))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer_chat(request, await _json_or_none(request))

    @_answers_errors
    async def answer_completion(self, request: web.Request, body: Any) -> web.StreamResponse:
        """Answer a /v1/completions `body` (already read from `request`)."""
        job = parse_completion(_checked_body(body), self.tokenizer, self.model_name,
                               self.max_model_len)
        return await self._answer(request, job, chat=False)

    @_answers_errors
    async def answer_chat(self, request: web.Request, body: Any) -> web.StreamResponse:
        """Answer a /v1/chat/completions `body` (already read from `request`)."""
        job = parse_chat(_checked_body(body), self.tokenizer, self.model_name,
                         self.max_model_len, self.native_tools, self.images)
        return await self._answer(request, job, chat=True)

    async def chat_json(self, body: dict) -> dict:
        """The chat.completion object for a non-streamed chat `body` (OpenAIError if bad)."""
        job = parse_chat(body, self.tokenizer, self.model_name, self.max_model_len,
                         self.native_tools, self.images)
        job.stream = False
        return await self._answer_json(job, chat=True)

    def prompt_length(self, body: dict) -> int:
        """The prompt token count of a chat `body` (OpenAIError if bad; no length limit)."""
        return len(parse_chat(body, self.tokenizer, self.model_name, None,
                              self.native_tools, self.images).prompts[0])

    # ---- answering ----------------------------------------------------------------------

    def _requests(self, job: Job) -> list[GenerationRequest]:
        """One request per choice: prompt i's n choices get indices i*n .. i*n+n-1 (and, with
        a seed, random streams derived from it by index)."""
        seed = job.sampling.seed
        return [GenerationRequest(input_ids=p, sampling=job.sampling if seed is None else
                                  dataclasses.replace(job.sampling, seed=mix_seed(seed, index)),
                                  images=job.images)
                for index, p in enumerate(p for p in job.prompts for _ in range(job.n))]

    async def _answer(self, request: web.Request, job: Job, *, chat: bool) -> web.StreamResponse:
        envelope = self._envelope(chat)
        self._check_engine_serves(job, chat)
        if job.stream:
            return await self._stream(request, job, envelope, chat=chat)
        return web.json_response(await self._answer_json(job, chat=chat, envelope=envelope))

    async def _answer_json(self, job: Job, *, chat: bool, envelope: dict | None = None) -> dict:
        envelope = envelope or self._envelope(chat)
        self._check_engine_serves(job, chat)
        try:
            resps = await asyncio.gather(*(self._generate(r, job) for r in self._requests(job)))
            echoes = await asyncio.gather(*(self.engine.ascore(p, job.top_logprobs)
                                            for p in job.prompts)) if _scores(job) else None
        except ValueError as e:  # the engine refused the prompt (length, vocabulary)
            raise OpenAIError(str(e), param="messages" if chat else "prompt") from None
        if chat:
            choices = [self._chat_choice(i, r, job) for i, r in enumerate(resps)]
        else:
            choices = [self._completion_choice(i, r, job, echoes[i // job.n] if echoes else None)
                       for i, r in enumerate(resps)]
        return {**envelope, "choices": choices, "system_fingerprint": None,
                "usage": _usage(job, resps)}

    def _check_engine_serves(self, job: Job, chat: bool) -> None:
        if job.images is not None and not getattr(self.engine, "serves_images", False):
            raise OpenAIError("messages: the request has images, but this backend sends its "
                              "servers no images; serve a vision-language model with our "
                              "engine (rollout.backend local)", param="messages")
        if (job.top_logprobs or _scores(job)) and not getattr(self.engine, "serves_top_logprobs",
                                                              False):
            param = "echo" if _scores(job) else "top_logprobs" if chat else "logprobs"
            what = "the prompt's log-probs" if _scores(job) else "top-k log-probs"
            raise OpenAIError(f"{param}: {what} are served by our own engine only, not by this "
                              "backend", param=param)

    async def _generate(self, req: GenerationRequest, job: Job) -> GenerationResponse:
        if job.generate:
            return await self.engine.agenerate(req)
        # echo with max_tokens 0: nothing sampled
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=[],
                                  output_logprobs=[], output_versions=[],
                                  stop_reason=StopReason.LENGTH,
                                  output_top_logprobs=[] if job.top_logprobs else None)

    def _envelope(self, chat: bool) -> dict:
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}

    def _completion_choice(self, index: int, resp: GenerationResponse, job: Job,
                           echo: tuple[list[float | None], list[dict | None]] | None) -> dict:
        text, offsets = detokenize(self.tokenizer, resp.output_ids, job.stop)
        ids, token_logprobs = list(resp.output_ids), list(resp.output_logprobs)
        tops: list[dict[int, float] | None] = [
            _with_sampled(top, t, lp) for t, lp, top in
            zip(ids, token_logprobs, resp.output_top_logprobs or [])]
        if job.echo:  # the prompt first, its first token without a log-prob
            prompt_text, prompt_offsets = detokenize(self.tokenizer, resp.input_ids)
            offsets = prompt_offsets + [len(prompt_text) + o for o in offsets]
            text = prompt_text + text
            ids = list(resp.input_ids) + ids
            if echo is not None:
                token_logprobs = echo[0] + token_logprobs
                tops = [None if top is None else _with_sampled(top, t, lp)
                        for t, lp, top in zip(resp.input_ids, echo[0], echo[1])] + tops
        logprobs = None
        if job.logprobs:
            logprobs = {"tokens": [self._token(t) for t in ids], "token_logprobs": token_logprobs,
                        "top_logprobs": [None if top is None else self._named(top)
                                         for top in tops] if job.top_logprobs else None,
                        "text_offset": offsets}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": _finish(resp.stop_reason), **_extension(resp)}

    def _named(self, top: dict[int, float]) -> dict[str, float]:
        """{token string: log-prob}, most likely first."""
        return {self._token(t): lp for t, lp in sorted(top.items(), key=lambda kv: -kv[1])}

    def tool_text(self, ids: list[int], stop: list[str] | tuple[str, ...]) -> str:
        """The text of completion `ids` with the tool-call markers kept, for `tool_format`."""
        return detokenize(self.tokenizer, ids, stop, self.tool_marker_ids)[0]

    def _chat_choice(self, index: int, resp: GenerationResponse, job: Job) -> dict:
        if job.tools:
            text = self.tool_text(resp.output_ids, job.stop)
            content, calls = self.tool_format.parse(text)
        else:
            content, calls = detokenize(self.tokenizer, resp.output_ids, job.stop)[0], []
        # OpenAI sends null content beside tool calls when the model wrote nothing else.
        message: dict[str, Any] = {"role": "assistant",
                                   "content": (content or None) if calls else content}
        finish = _finish(resp.stop_reason)
        if calls:
            message["tool_calls"] = calls
            finish = "length" if finish == "length" else "tool_calls"
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": self._chat_logprobs(resp.output_ids, resp.output_logprobs,
                                                resp.output_top_logprobs)
                if job.logprobs else None, **_extension(resp)}

    def _token(self, token_id: int) -> str:
        return token_string(token_bytes(self.tokenizer, token_id))

    def _chat_logprobs(self, ids: list[int], logprobs: list[float],
                       tops: list[dict[int, float]] | None = None) -> dict:
        entries = []
        for i, (t, lp) in enumerate(zip(ids, logprobs)):
            entry = self._chat_entry(t, lp)
            top = tops[i] if tops else {}
            entry["top_logprobs"] = [self._chat_entry(a, alp) for a, alp in
                                     sorted(top.items(), key=lambda kv: -kv[1])]
            entries.append(entry)
        return {"content": entries, "refusal": None}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(self.tokenizer, token_id)
        return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}

    # ---- streaming --------------------------------------------------------------------

    async def _stream(self, request: web.Request, job: Job, envelope: dict, *,
                      chat: bool) -> web.StreamResponse:
        finals: list[GenerationResponse] = []
        try:  # start every generation before answering, so a refused prompt is still a 400
            streams = [self._tokens(r) for r in self._requests(job)]
        except ValueError as e:
            raise OpenAIError(str(e), param="messages" if chat else "prompt") from None
        per_choice = self._chat_chunks if chat else self._completion_chunks
        chunks = _merge([per_choice(i, s, job, finals) for i, s in enumerate(streams)])
        envelope = {**envelope, "object": "chat.completion.chunk" if chat else "text_completion"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for choice in chunks:
                await _send(resp, {**envelope, "choices": [choice]})
            if job.include_usage:
                await _send(resp, {**envelope, "choices": [], "usage": _usage(job, finals)})
        except (InferenceError, RuntimeError, ValueError) as e:  # headers are gone: say it inline
            await _send(resp, OpenAIError(f"generation failed: {e}", status=500,
                                          type="server_error").body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _tokens(self, req: GenerationRequest) -> AsyncIterator[StreamedToken | GenerationResponse]:
        if hasattr(self.engine, "astream"):
            return self.engine.astream(req)
        return _replay(self.engine, req)

    async def _completion_chunks(self, index: int, stream: AsyncIterator, job: Job,
                                 finals: list[GenerationResponse]) -> AsyncIterator[dict]:
        detok = IncrementalDetokenizer(self.tokenizer, job.stop)
        first = True
        async for item in stream:
            if isinstance(item, GenerationResponse):
                finals.append(item)
                yield {"index": index, "text": detok.finish(), "logprobs": None,
                       "finish_reason": _finish(item.stop_reason)}
                return
            offset = detok.emitted
            choice = {"index": index, "text": detok.push(item.id), "finish_reason": None,
                      "logprobs": {"tokens": [self._token(item.id)],
                                   "token_logprobs": [item.logprob], "top_logprobs": None,
                                   "text_offset": [offset]} if job.logprobs else None,
                      **_token_fields(item)}
            if first:
                choice["prompt_token_ids"], first = list(job.prompts[index // job.n]), False
            yield choice

    async def _chat_chunks(self, index: int, stream: AsyncIterator, job: Job,
                           finals: list[GenerationResponse]) -> AsyncIterator[dict]:
        detok = IncrementalDetokenizer(self.tokenizer, job.stop,
                                       self.tool_marker_ids if job.tools else ())
        hold = ToolCallHold(self.tool_format) if job.tools else None
        first = True
        async for item in stream:
            if isinstance(item, GenerationResponse):
                finals.append(item)
                yield self._last_chat_chunk(index, item, detok, hold, first)
                return
            text = detok.push(item.id)
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            text = hold.push(text) if hold else text
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": None,
                      "logprobs": self._chat_logprobs([item.id], [item.logprob])
                      if job.logprobs else None, **_token_fields(item)}
            if first:
                choice["prompt_token_ids"], first = list(job.prompts[index // job.n]), False
            yield choice

    def _last_chat_chunk(self, index: int, resp: GenerationResponse,
                         detok: IncrementalDetokenizer, hold: ToolCallHold | None,
                         first: bool) -> dict:
        text, calls = detok.finish(), []
        if hold is not None:
            text = hold.push(text)
            rest, calls = self.tool_format.parse(hold.finish())
            text += rest
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        finish = _finish(resp.stop_reason)
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            finish = "length" if finish == "length" else "tool_calls"
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}


_NOT_JSON = object()


async def _json_or_none(request: web.Request) -> Any:
    """The JSON body, or a marker that `_checked_body` turns into a 400."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _NOT_JSON


def _checked_body(body: Any) -> Any:
    if body is _NOT_JSON:
        raise OpenAIError("the body is not valid JSON")
    return body


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


async def _replay(engine: Any, req: GenerationRequest
                  ) -> AsyncIterator[StreamedToken | GenerationResponse]:
    """A finished generation as a token stream, for engines without `astream`."""
    resp = await engine.agenerate(req)
    for item in zip(resp.output_ids, resp.output_logprobs, resp.output_versions):
        yield StreamedToken(*item)
    yield resp


_END = object()


async def _merge(gens: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """Items of several async iterators as they come; the first error is raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: AsyncIterator[dict]) -> None:
        try:
            async for item in gen:
                await queue.put(item)
            await queue.put(_END)
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _finish(reason: StopReason) -> str:
    return {StopReason.STOP: "stop", StopReason.LENGTH: "length"}.get(reason, reason.value)


def _extension(resp: GenerationResponse) -> dict[str, Any]:
    return {"prompt_token_ids": list(resp.input_ids), "token_ids": list(resp.output_ids),
            "token_logprobs": list(resp.output_logprobs),
            "token_versions": list(resp.output_versions)}


def _token_fields(tok: StreamedToken) -> dict[str, Any]:
    return {"token_ids": [tok.id], "token_logprobs": [tok.logprob], "token_versions": [tok.version]}


def _with_sampled(top: dict[int, float], token: int, logprob: float) -> dict[int, float]:
    """`top` with the chosen token added when it is not among them (vLLM's completions)."""
    return top if token in top else {**top, token: logprob}


def _scores(job: Job) -> bool:
    """Whether `job` needs its prompts' log-probs (echo with logprobs)."""
    return job.echo and job.logprobs


def _usage(job: Job, resps: list[GenerationResponse]) -> dict[str, int]:
    prompt = sum(len(p) for p in job.prompts)  # counted once per prompt, as OpenAI does
    completion = sum(len(r.output_ids) for r in resps)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def openai_app(engine: Any, tokenizer: Any, model_name: str, *, api_key: str | None = None,
               max_model_len: int | None = None, tool_parser: str | None = None,
               images: ImagePrompts | None = None) -> web.Application:
    """A stand-alone app serving the /v1 routes (the gateway's, and tests')."""
    app = web.Application(middlewares=[openai_auth(api_key)])
    OpenAIRoutes(engine, tokenizer, model_name, max_model_len=max_model_len,
                 tool_parser=tool_parser, images=images).add_to(app)
    spec = openapi.gateway(model_name, api_key=bool(api_key))

    async def description(request: web.Request) -> web.Response:
        return web.json_response(spec)

    app.router.add_get("/openapi.json", description)
    return app
