"""The agent proxy: OpenAI- and Anthropic-shaped routes that record every session exactly.

    POST /rl/start_session {task_id?, api_key?}     admin key  -> {session_id, api_key}
    POST /rl/set_reward {reward, completion_id?}    session key (or admin key + session_id)
    POST /rl/end_session {}                         session key (or admin key + session_id)
    POST /rl/close_session {session_id, reward?, failure?}
                                                    admin key: end it, return it whole
    GET  /rl/sessions                               admin key: counts and active sessions
    POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages,
    /v1/messages/count_tokens; GET /v1/models, /v1/models/{model}
                                                    session key (Bearer, or x-api-key)
    POST /untrained/v1/chat/completions             session key: the served model for a
                                                    session's other party (a simulated
                                                    user), its own sampling, not recorded
    GET|HEAD /                                      open: 200 (the base URL answers)

An agent is configured with the proxy's base_url and a session key; whatever it sends,
the proxy generates through an `InferenceEngine` and keeps, per completion, the exact
prompt and output ids, log-probs and weight versions (`agents/capture.py`).

- Capacity: `admission.admit` decides whether a session may start (the trainer's
  staleness rule in `asyncrl train`; a session count in `asyncrl serve`). No: HTTP 429
  with Retry-After.
- Retries: a request with `x-stainless-retry-count` > 0 and the same body as an earlier one
  of its session gets the first request's samples again (awaiting them if still running),
  not new ones.
- History: an assistant message the proxy itself returned is rendered as the model wrote
  it (its raw text, tool calls and their marker tokens such as `<|python_tag|>` included),
  so the next turn's prompt extends the sampled tokens exactly whenever the tokenizer
  round-trips that text. `tool_parser` names the tool-call format (default: the template's).
- Idle sessions end after `session_timeout` seconds with status `timed_out`; a session
  more than `max_session_version_lag` versions behind the served weights ends with status
  `version_lag` and its requests get 409. Both are counted and logged, never trained.
- Untrained calls: a conversation partner played by the served model (a simulated user, a
  judge) talks through `/untrained/v1` with its session's key. It samples as its request
  says (the trainer's sampling is not forced on it) and nothing of it is recorded, so its
  tokens never reach a trajectory; only its count is kept (`sessions/untrained_completions`).
- Restarts: sessions live in the proxy's memory. A key or session id that an earlier
  process of the proxy issued gets 410 `session_lost` (its session is gone, none of it is
  trained), not 401.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import signal
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aiohttp import web

from asyncrl.agents.capture import Completion
from asyncrl.agents.export import SessionWriter
from asyncrl.agents.session import (
    LOST,
    Session,
    SessionError,
    SessionStatus,
    SessionStore,
)
from asyncrl.api import openapi
from asyncrl.api.http import SHUTDOWN_GRACE_S
from asyncrl.api.types import GenerationRequest, GenerationResponse, ImageInputs
from asyncrl.inference.gateway import backend_model, load_tokenizer, make_engine
from asyncrl.openai.anthropic import AnthropicRoutes
from asyncrl.openai.detokenize import detokenize
from asyncrl.openai.drift import check_template_drift
from asyncrl.openai.images import ImagePrompts
from asyncrl.openai.protocol import OpenAIError
from asyncrl.openai.responses import ResponsesRoutes
from asyncrl.openai.routes import OpenAIRoutes, _checked_body, _json_or_none, root

logger = logging.getLogger(__name__)
_MAX_ENDED_KEYS = 100_000  # keys of ended sessions remembered, to answer 409 rather than 401
_MAX_ENDED_SESSIONS = 4096  # ended sessions kept in memory (status, reason, completions)
_MAX_BODY = 8 * 2**20  # bytes; larger requests get 413


class Admission(Protocol):
    """Whether a session may start now; `start(version)` makes it when it may."""

    def admit(self, start: Callable[[int], Session]) -> Session | None: ...


# What `close_session` did: ended it; it had ended before; it failed; a reward came for a
# session without a completion (ended as failed).
CloseOutcome = Literal["ended", "already_ended", "failed", "no_completion"]


class SessionLimit:
    """Admission by a cap on active sessions (serving without a trainer)."""

    def __init__(self, store: SessionStore, max_sessions: int) -> None:
        self.store, self.max_sessions = store, max_sessions

    def admit(self, start: Callable[[int], Session]) -> Session | None:
        if len(self.store.active()) >= self.max_sessions:
            return None
        return start(0)


@dataclass
class _Record:
    """One request being answered: its session, its retry key, the samples it got."""

    session: Session
    key: str
    replay: bool
    body: Any = None
    responses: list[tuple[int, GenerationResponse]] = field(default_factory=list)
    images: ImageInputs | None = None  # the images of the request's prompt
    index: int = 0
    lost: bool = False  # the client went away before the answer reached it


_current: contextvars.ContextVar[_Record | None] = contextvars.ContextVar("agent_request",
                                                                          default=None)


class RecordingEngine:
    """An engine wrapper that records each generation into the request's session."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def serves_images(self) -> bool:
        return getattr(self.engine, "serves_images", False)

    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        rec = _current.get()
        if rec is None:
            return await self.engine.agenerate(req)
        index, rec.index = rec.index, rec.index + 1
        rec.images = req.images  # one request's choices share its prompt and images
        futures = rec.session.retry_cache.setdefault(rec.key, [])
        if rec.replay and index < len(futures):
            resp = await asyncio.shield(futures[index])
            rec.responses.append((index, resp))  # recorded here if the first answer was lost
            return resp
        # The session's turns go to one server, where their shared prefix is.
        req = dataclasses.replace(req, sampling=_override(req.sampling, rec.session.sampling),
                                  affinity=rec.session.id)
        future = asyncio.get_running_loop().create_future()
        if index < len(futures):
            futures[index] = future
        else:
            futures.append(future)
        try:
            resp = await self.engine.agenerate(req)
        except BaseException:
            futures.remove(future)  # a retry generates anew
            future.cancel()
            raise
        future.set_result(resp)
        rec.responses.append((index, resp))
        return resp


def _override(sampling: Any, forced: dict[str, Any]) -> Any:
    """The request's sampling with the session's forced values (temperature, caps)."""
    if not forced:
        return sampling
    changes = {k: forced[k] for k in ("temperature", "top_p", "top_k") if k in forced}
    if "max_new_tokens" in forced:
        changes["max_new_tokens"] = min(sampling.max_new_tokens, forced["max_new_tokens"])
    if forced.get("stop_token_ids"):
        changes["stop_token_ids"] = sorted(set(sampling.stop_token_ids)
                                           | set(forced["stop_token_ids"]))
    return dataclasses.replace(sampling, **changes)


def _error(status: int, message: str, *, code: str | None = None,
           param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    err = OpenAIError(message, status=status, code=code, param=param,
                      type="invalid_request_error" if status < 500 else "server_error")
    return web.json_response(err.body(), status=status, headers=headers)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return request.headers.get("x-api-key")


def _assistant_key(content: Any, calls: list[dict[str, Any]] | None) -> str:
    """A canonical form of an assistant turn: its text and its calls' names and arguments."""
    def canon(arguments: Any) -> Any:
        try:
            return json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            return arguments
    norm = [(c["function"]["name"], canon(c["function"].get("arguments")))
            for c in calls or [] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    text = content.strip() if isinstance(content, str) else ""
    return json.dumps([text, norm], sort_keys=True, ensure_ascii=False)


class AgentProxy:
    """Sessions, recording and the HTTP routes; runs on one event loop."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *,
                 admin_key: str | None = None, admission: Admission | None = None,
                 version: Callable[[], int] = lambda: 0, session_timeout: float = 600.0,
                 max_session_version_lag: int | None = None, max_model_len: int | None = None,
                 sampling: dict[str, Any] | None = None,
                 on_end: Callable[[Session], None] | None = None,
                 tool_parser: str | None = None, images: ImagePrompts | None = None) -> None:
        """`images`: the processor of a model that reads images (`load_image_prompts`);
        None: image parts and blocks are refused."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.admin_key = admin_key
        self.version = version
        self.session_timeout = session_timeout
        self.max_session_version_lag = max_session_version_lag
        self.sampling = dict(sampling or {})  # forced on every session's requests
        self.on_end = on_end
        self.store = SessionStore(on_end=self._ended)
        self.admission = admission or SessionLimit(self.store, 256)
        self.routes = OpenAIRoutes(RecordingEngine(engine), tokenizer, model_name,
                                   max_model_len=max_model_len, tool_parser=tool_parser,
                                   images=images)
        # The same engine unwrapped: what it generates is never recorded (`_untrained_chat`).
        self.untrained = OpenAIRoutes(engine, tokenizer, model_name,
                                      max_model_len=max_model_len, tool_parser=tool_parser,
                                      images=images)
        self.counts = {"late_completions": 0, "retries_replayed": 0, "rejected_429": 0,
                       "untrained_completions": 0, "lost_answers": 0}
        self._raw: dict[str, dict[str, str]] = {}  # session id -> assistant key -> raw text
        self._samples: dict[str, set[int]] = {}  # session id -> ids of the samples recorded
        self._ended_keys: OrderedDict[str, str] = OrderedDict()  # key -> session id
        self._ended_ids: deque[str] = deque()  # ended sessions still held, oldest first
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None
        self.base_url = ""
        # served beside the proxy's own (agents/service.py)
        self.extra_routes: list[web.RouteDef] = []

    # ---- sessions (in-process API) ------------------------------------------------------

    def start_session(self, *, task_id: str | None = None, api_key: str | None = None,
                      start_version: int | None = None,
                      sampling: dict[str, Any] | None = None) -> Session:
        """A session without the admission check (its caller already counts it)."""
        version = self.version() if start_version is None else start_version
        return self.store.start(task_id=task_id, api_key=api_key,
                                start_version=version, sampling={**self.sampling,
                                                                 **(sampling or {})})

    def end_session(self, session: Session, status: SessionStatus = SessionStatus.ENDED,
                    reason: str = "") -> bool:
        return self.store.end(session, status, reason)

    def close_session(self, session: Session, *, reward: float | None = None,
                      failure: str | None = None) -> CloseOutcome:
        """End the session its runner started, once its agent returned (or failed).

        `failure`: the agent failed; the session ends as `failed` with that reason. Else
        `reward` (the agent's return value; None: it set its rewards itself) goes to the
        last completion and the session ends. A session that had already ended keeps its
        status; one its agent ended itself (`ended`) still takes the returned reward.
        """
        if failure is not None:
            return "failed" if self.store.end(session, SessionStatus.FAILED, failure) \
                else "already_ended"
        if reward is not None and not session.completions:
            refused = f"; its last refused request: {session.refused[-1]}" if session.refused \
                else ""
            self.store.end(session, SessionStatus.FAILED, "no model call" + refused)
            return "no_completion"
        if not session.active:
            if session.status is SessionStatus.ENDED and reward is not None:
                session.completions[-1].reward = float(reward)
            return "already_ended"
        if reward is not None:
            session.set_reward(reward)
        self.store.end(session, SessionStatus.ENDED)
        return "ended"

    def _ended(self, session: Session) -> None:
        self._ended_keys[session.api_key] = session.id
        while len(self._ended_keys) > _MAX_ENDED_KEYS:
            self._ended_keys.popitem(last=False)
        self._ended_ids.append(session.id)
        while len(self._ended_ids) > _MAX_ENDED_SESSIONS:  # their exports are long done
            self.store.forget(self.store.by_id[self._ended_ids.popleft()])
        self._raw.pop(session.id, None)
        self._samples.pop(session.id, None)
        session.retry_cache.clear()
        if self.on_end is not None:
            self.on_end(session)

    def stats(self) -> dict[str, float]:
        """Session counts by outcome, active sessions and proxy events."""
        out = {f"sessions/{k}": float(v) for k, v in self.store.counts.items()}
        out["sessions/active"] = float(len(self.store.active()))
        return out | {f"sessions/{k}": float(v) for k, v in self.counts.items()}

    # ---- serving ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY)
        app.add_routes([
            web.get("/health", self._health),
            web.get("/openapi.json", self._openapi),
            web.post("/rl/start_session", self._start_session),
            web.post("/rl/set_reward", self._set_reward),
            web.post("/rl/end_session", self._end_session),
            web.post("/rl/close_session", self._close_session),
            web.get("/rl/sessions", self._sessions),
            web.get("/v1/models", self._models),
            web.get("/v1/models/{model}", self._model),
            web.post("/v1/chat/completions", self._chat),
            web.post("/v1/completions", self._completions),
            web.post("/untrained/v1/chat/completions", self._untrained_chat),
        ])
        responses = ResponsesRoutes(self._chat_fn, self.model_name)
        messages = AnthropicRoutes(self._chat_fn, self.model_name, self._count_fn,
                                   reads_images=self.routes.images is not None)
        app.router.add_post("/v1/responses", self._wrap("responses", responses.create))
        app.router.add_post("/v1/messages", self._wrap("messages", messages.create))
        app.router.add_post("/v1/messages/count_tokens", self._keyed(messages.count_tokens))
        app.router.add_get("/", root)
        app.add_routes(self.extra_routes)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on the running loop; returns the base URL (http://host:port/v1)."""
        self._runner = web.AppRunner(self.app(), access_log=None,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.base_url = f"http://{bound[0]}:{bound[1]}/v1"
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        logger.info("agent proxy listening on %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        """Stop serving; sessions still active end as `cancelled` (reported, not trained)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for s in self.store.active():
            self.store.end(s, SessionStatus.CANCELLED, "the proxy shut down")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _reap(self) -> None:
        period = max(0.05, min(5.0, self.session_timeout / 4))
        while True:
            await asyncio.sleep(period)
            self.store.expire(self.session_timeout)

    # ---- /rl/* ------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.version(),
                                  "active_sessions": len(self.store.active())})

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.agent_proxy(self.model_name))

    def is_admin(self, request: web.Request) -> bool:
        key = _bearer(request)
        return bool(self.admin_key and key
                    and hmac.compare_digest(key.encode(), self.admin_key.encode()))

    async def _start_session(self, request: web.Request) -> web.Response:
        if not self.admin_key:
            return _error(403, "starting sessions over HTTP needs the proxy to have an admin "
                          "key (--admin-key / agent.admin_key)")
        if not self.is_admin(request):
            return _error(401, "missing or wrong admin key (Authorization: Bearer <admin key>)",
                          code="invalid_api_key")
        body = await _rl_body(request, {"task_id", "api_key", "sampling", "admitted",
                                        "start_version"})
        if isinstance(body, web.Response):
            return body
        task_id, api_key = body.get("task_id"), body.get("api_key")
        for name, value in (("task_id", task_id), ("api_key", api_key)):
            if value is not None and not isinstance(value, str):
                return _error(400, f"{name} must be a string", param=name)
        sampling = body.get("sampling", {})
        if not isinstance(sampling, dict):
            return _error(400, "sampling must be an object of sampling fields", param="sampling")
        admitted, start_version = body.get("admitted", False), body.get("start_version")
        if not isinstance(admitted, bool):
            return _error(400, "admitted must be true or false", param="admitted")
        if start_version is not None and (not admitted or isinstance(start_version, bool)
                                          or not isinstance(start_version, int)):
            return _error(400, "start_version (an integer) goes only with admitted=true",
                          param="start_version")

        def start(version: int) -> Session:
            return self.start_session(task_id=task_id, api_key=api_key, sampling=sampling,
                                      start_version=version)
        try:
            # admitted: the caller (a trainer's agent runner) already counted this episode
            # under its staleness bound, so the proxy's own admission is not asked.
            session = start(self.version() if start_version is None else start_version) \
                if admitted else self.admission.admit(start)
        except SessionError as e:
            return _error(e.status, str(e), param="api_key")
        if session is None:
            self.counts["rejected_429"] += 1
            return _error(429, "no session can start now: the trainer's staleness bound "
                          "(or the session limit) is reached; retry later",
                          code="capacity", headers={"Retry-After": "1"})
        return web.json_response({"session_id": session.id, "api_key": session.api_key,
                                  "start_version": session.start_version})

    def _target(self, request: web.Request, body: dict) -> Session | web.Response:
        """The session a /rl call is about: the caller's key, or admin key + session_id."""
        if self.is_admin(request):
            if not isinstance(body.get("session_id"), str):
                return _error(400, "session_id (a string) is needed with the admin key",
                              param="session_id")
            try:
                return self.store.get(body["session_id"])
            except SessionError as e:
                return _error(e.status, str(e), param="session_id")
        if "session_id" in body:
            return _error(400, "session_id is only for the admin key; a session key names "
                          "its session", param="session_id")
        return self._session(request)

    async def _session_call(self, request: web.Request,
                            allowed: set[str]) -> tuple[dict, Session] | web.Response:
        """The body of a /rl/* call about one session, and that session."""
        if not self.is_admin(request):  # the key first: nothing is read for a wrong one
            session = self._session(request)
            if isinstance(session, web.Response):
                return session
        body = await _rl_body(request, allowed | {"session_id"})
        if isinstance(body, web.Response):
            return body
        session = self._target(request, body)
        return session if isinstance(session, web.Response) else (body, session)

    async def _set_reward(self, request: web.Request) -> web.Response:
        call = await self._session_call(request, {"reward", "completion_id"})
        if isinstance(call, web.Response):
            return call
        body, session = call
        reward = body.get("reward")
        if not _is_reward(reward):
            return _error(400, f"reward must be a finite number, got {reward!r}", param="reward")
        cid = body.get("completion_id")
        if cid is not None and not isinstance(cid, str):
            return _error(400, "completion_id must be a string", param="completion_id")
        try:
            target = session.set_reward(reward, cid)
        except SessionError as e:
            return _error(e.status, str(e), param="completion_id" if e.status == 404 else None)
        session.touch()
        return web.json_response({"session_id": session.id, "completion_id": target.id,
                                  "reward": target.reward})

    async def _end_session(self, request: web.Request) -> web.Response:
        call = await self._session_call(request, set())
        if isinstance(call, web.Response):
            return call
        _, session = call
        if not self.store.end(session, SessionStatus.ENDED, "end_session"):
            return _error(409, f"session {session.id} already ended ({session.status.value})")
        return web.json_response(session.summary())

    async def _close_session(self, request: web.Request) -> web.Response:
        if not self.is_admin(request):
            return _error(401, "missing or wrong admin key", code="invalid_api_key")
        call = await self._session_call(request, {"reward", "failure"})
        if isinstance(call, web.Response):
            return call
        body, session = call
        reward, failure = body.get("reward"), body.get("failure")
        if reward is not None and not _is_reward(reward):
            return _error(400, f"reward must be a finite number, got {reward!r}", param="reward")
        if failure is not None and not isinstance(failure, str):
            return _error(400, "failure must be a string (why the agent failed)", param="failure")
        outcome = self.close_session(session, reward=reward, failure=failure)
        return web.json_response({"outcome": outcome, "session": session.to_record()})

    async def _sessions(self, request: web.Request) -> web.Response:
        if not self.is_admin(request):
            return _error(401, "missing or wrong admin key", code="invalid_api_key")
        return web.json_response({"counts": self.stats(), "version": self.version(),
                                  "active": [s.summary() for s in self.store.active()]})

    # ---- /v1/* ------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session | web.Response:
        """The active session of the request's key; 401 for unknown keys, 409 if it ended,
        410 if an earlier process of the proxy issued it."""
        key = _bearer(request)
        session = self.store.by_api_key(key) if key else None
        if session is not None:
            return session
        if key and key in self._ended_keys:
            sid = self._ended_keys[key]
            ended = self.store.by_id.get(sid)
            why = f" ({ended.status.value}: {ended.reason})" if ended else ""
            return _error(409, f"session {sid} has ended{why}; start a new session",
                          code="session_ended")
        if key and self.store.from_earlier_proxy(key):
            return _error(410, LOST.format(what="this key's session"), code="session_lost")
        return _error(401, "missing or wrong API key: use the api_key of an active session "
                      "(Authorization: Bearer <key>)", code="invalid_api_key")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        return session if isinstance(session, web.Response) else await self.routes.models(request)

    async def _model(self, request: web.Request) -> web.StreamResponse:
        # Any model name is answered by the served policy, so any name is a model here.
        session = self._session(request)
        return session if isinstance(session, web.Response) else \
            web.json_response(self.routes.card(request.match_info["model"]))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        async def answer() -> web.StreamResponse:
            body = await _json_or_none(request)
            if isinstance(body, dict):
                body = self._prepare_chat(_current.get().session, body)
            _current.get().body = body
            return await self.routes.answer_chat(request, body)
        return await self._recorded(request, "chat", answer)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        async def answer() -> web.StreamResponse:
            body = await _json_or_none(request)
            if isinstance(body, dict):
                body = {**body, "model": self.model_name}
            _current.get().body = body
            return await self.routes.answer_completion(request, body)
        return await self._recorded(request, "completions", answer)

    async def _untrained_chat(self, request: web.Request) -> web.StreamResponse:
        """A chat completion for the other party of a session (a simulated user): the
        request's own sampling, nothing recorded, so none of it is ever trained."""
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        body = await _json_or_none(request)
        if isinstance(body, dict):
            body = {**body, "model": self.model_name}
        self.counts["untrained_completions"] += 1
        session.inflight += 1  # an idle timeout waits for it, as for the agent's own calls
        session.touch()
        try:
            return await self.untrained.answer_chat(request, body)
        finally:
            session.inflight -= 1
            session.touch()

    async def _chat_fn(self, request: web.Request, chat_body: dict) -> dict:
        """The chat callable under /v1/responses and /v1/messages (inside `_recorded`)."""
        rec = _current.get()
        body = self._prepare_chat(rec.session, _checked_body(chat_body))
        rec.body = body
        return await self.routes.chat_json(body)

    async def _count_fn(self, request: web.Request, chat_body: dict) -> int:
        """The prompt length of a chat body, as the session's next request would render it."""
        session = self._session(request)
        if isinstance(session, web.Response):  # `_keyed` answers these before
            raise OpenAIError("missing or wrong API key", status=401, code="invalid_api_key")
        return self.routes.prompt_length(self._prepare_chat(session, chat_body))

    def _keyed(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """`handler` for requests with an active session's key; nothing is recorded."""
        async def wrapped(request: web.Request) -> web.StreamResponse:
            session = self._session(request)
            return session if isinstance(session, web.Response) else await handler(request)
        return wrapped

    def _wrap(self, route: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            return await self._recorded(request, route, lambda: handler(request))
        return wrapped

    def _prepare_chat(self, session: Session, body: dict) -> dict:
        """Any model name is this model; assistant turns we returned keep their raw text."""
        body = {**body, "model": self.model_name}
        raw = self._raw.get(session.id)
        messages = body.get("messages")
        if raw and isinstance(messages, list):
            out = []
            for m in messages:
                if isinstance(m, dict) and m.get("role") == "assistant":
                    text = raw.get(_assistant_key(m.get("content"), m.get("tool_calls")))
                    if text is not None:
                        m = {"role": "assistant", "content": text}
                out.append(m)
            body["messages"] = out
        return body

    async def _recorded(self, request: web.Request, route: str,
                        answer: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Answer a generation request of a session, then keep what it sampled."""
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        lag = self.version() - session.start_version
        if self.max_session_version_lag is not None and lag > self.max_session_version_lag:
            self.store.end(session, SessionStatus.VERSION_LAG,
                           f"started at weight version {session.start_version}, now "
                           f"{self.version()} (max_session_version_lag="
                           f"{self.max_session_version_lag})")
            return self._session(request)  # the 409 that says why
        raw = await request.read()
        key = route + ":" + hashlib.sha256(raw).hexdigest()
        retry = _retry_count(request) > 0 and key in session.retry_cache
        if retry:
            self.counts["retries_replayed"] += 1
        rec = _Record(session, key, replay=retry)
        token = _current.set(rec)
        session.inflight += 1
        session.touch()
        try:
            response = await answer()
            if response.status >= 400:
                session.note_refused(f"{request.method} {request.path} {response.status}: "
                                     f"{_error_message(response)}")
            # An answer not yet sent (not streamed) to a client that has hung up (its own
            # timeout) never reaches it: what the agent saw is what its retry gets.
            rec.lost = not response.prepared and (request.transport is None or
                                                  request.transport.is_closing())
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            rec.lost = True  # a stream cut off by the client
            raise
        finally:
            session.inflight -= 1
            session.touch()
            _current.reset(token)
            self._commit(rec, route)  # replayed samples are not in rec.responses

    def _commit(self, rec: _Record, route: str) -> None:
        """Add the request's samples to its session, in choice order."""
        session = rec.session
        seen = self._samples.get(session.id, set())
        fresh = [(i, r) for i, r in rec.responses if id(r) not in seen]  # a replay: once
        if not fresh:
            return
        if rec.lost:
            self.counts["lost_answers"] += len(fresh)
            logger.info("session %s: the client left before its answer arrived; %d samples "
                        "not recorded (a retry of the request records what it gets)",
                        session.id, len(fresh))
            return
        if not session.active:
            self.counts["late_completions"] += len(fresh)
            logger.warning("session %s ended (%s) while a request was answered; %d samples "
                           "not recorded", session.id, session.status.value, len(fresh))
            return
        rec.responses = fresh
        # ids stay unique: retry_cache holds the samples until the session ends
        self._samples.setdefault(session.id, set()).update(id(r) for _, r in fresh)
        body = rec.body if isinstance(rec.body, dict) else {}
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        record = {k: body[k] for k in ("messages", "tools", "prompt") if k in body}
        # Parsed as the routes parsed it, so the key matches the message the client got back.
        tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        for _, resp in sorted(rec.responses, key=lambda x: x[0]):
            text = self.routes.tool_text(resp.output_ids, stop) if tools \
                else detokenize(self.tokenizer, resp.output_ids, stop)[0]
            c = Completion(id=f"{session.id}-{len(session.completions)}",
                           prompt_ids=list(resp.input_ids), output_ids=list(resp.output_ids),
                           logprobs=list(resp.output_logprobs),
                           versions=list(resp.output_versions), stop_reason=resp.stop_reason,
                           route=route, request=record, text=text, images=rec.images)
            session.completions.append(c)
            content, calls = self.routes.tool_format.parse(text) if tools else (text, [])
            self._raw.setdefault(session.id, {})[_assistant_key(content, calls)] = text


class LocalSessions:
    """An agent workflow's sessions on a proxy in this process (the workflow's `SessionHost`)."""

    def __init__(self, proxy: AgentProxy) -> None:
        self.proxy = proxy

    @property
    def base_url(self) -> str:
        return self.proxy.base_url

    async def open(self, *, task_id: str, sampling: dict[str, Any]) -> tuple[str, str]:
        session = self.proxy.start_session(task_id=task_id, sampling=sampling)
        return session.id, session.api_key

    async def close(self, session_id: str, *, reward: float | None = None,
                    failure: str | None = None) -> tuple[CloseOutcome, Session]:
        session = self.proxy.store.get(session_id)
        return self.proxy.close_session(session, reward=reward, failure=failure), session

    def abandon(self, session_id: str, reason: str) -> None:
        session = self.proxy.store.by_id.get(session_id)
        if session is not None:
            self.proxy.end_session(session, SessionStatus.FAILED, reason)


def _error_message(response: web.StreamResponse) -> str:
    """The message of an error answer, OpenAI's or Anthropic's shape (else its status text)."""
    body = getattr(response, "body", None)
    try:
        error = json.loads(body)["error"] if isinstance(body, bytes) else {}
    except (json.JSONDecodeError, KeyError, TypeError):
        error = {}
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else (response.reason or "")


def _is_reward(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value)


def _retry_count(request: web.Request) -> int:
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0


async def _rl_body(request: web.Request, allowed: set[str]) -> dict | web.Response:
    """A /rl/* JSON object body with only `allowed` fields (an empty body is {})."""
    if not await request.read():
        return {}
    body = await _json_or_none(request)
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        return _error(400, f"unknown field {unknown[0]!r}; allowed: {sorted(allowed)}",
                      param=unknown[0])
    return body


async def serve(backend: str, url: str, *, tokenizer: str | None, model_name: str | None,
                host: str, port: int, admin_key: str, export_dir: str | None,
                session_timeout: float = 600.0, max_sessions: int = 256,
                max_model_len: int | None = None, startup_timeout: float = 60.0,
                tool_parser: str | None = None) -> None:
    """The proxy in front of the inference server at `url`, without a trainer, until signalled.

    Each finished session is written to `export_dir` (sessions.jsonl, trajectories.jsonl).
    """
    engine = make_engine(backend, url, os.environ.get("ASYNCRL_API_KEY") or None)
    await engine.wait_healthy(timeout=startup_timeout)
    if tokenizer is None:
        if backend != "local":
            raise SystemExit(f"--tokenizer is needed with --backend {backend}")
        tokenizer = await backend_model(engine)
    tok = load_tokenizer(tokenizer)
    writer = SessionWriter(export_dir) if export_dir else None
    proxy = AgentProxy(engine, tok, model_name or tokenizer, admin_key=admin_key,
                       session_timeout=session_timeout, max_model_len=max_model_len,
                       on_end=writer, tool_parser=tool_parser)
    proxy.admission = SessionLimit(proxy.store, max_sessions)
    logger.info("%s", check_template_drift(tok, proxy.routes.native_tools).describe())
    print(f"asyncrl agent proxy: sessions written to "
          f"{export_dir or 'nowhere (no --export-dir)'}", flush=True)
    await serve_until_signalled(proxy, engine, host, port, "asyncrl agent proxy")


async def serve_until_signalled(proxy: AgentProxy, engine: Any, host: str, port: int,
                                banner: str) -> None:
    """Serve `proxy` until SIGTERM/SIGINT, then end its sessions and close `engine`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start(host, port)
    print(f"{banner}: OpenAI base_url {proxy.base_url}", flush=True)
    print(f"{banner} listening on {proxy.base_url.removesuffix('/v1')}", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.stop()
        await engine.close()


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.agents.proxy --backend-url URL --admin-key K --export-dir D`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m asyncrl.agents.proxy",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend-url", required=True, help="the inference server, http://HOST:PORT")
    p.add_argument("--backend", default="local", choices=("local", "vllm", "sglang"))
    p.add_argument("--tokenizer", default=None, help="default: the model the backend serves")
    p.add_argument("--model-name", default=None)
    p.add_argument("--admin-key", default=os.environ.get("ASYNCRL_ADMIN_KEY"),
                   help="bearer key of /rl/start_session (default: $ASYNCRL_ADMIN_KEY)")
    p.add_argument("--export-dir", default=None)
    p.add_argument("--session-timeout", type=float, default=600.0)
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tool-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="the model's tool-call format (default: read from its chat template)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    args = p.parse_args(argv)
    if not args.admin_key:
        p.error("--admin-key (or $ASYNCRL_ADMIN_KEY) is required: it guards /rl/start_session")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.backend, args.backend_url, tokenizer=args.tokenizer,
                      model_name=args.model_name, host=args.host, port=args.port,
                      admin_key=args.admin_key, export_dir=args.export_dir,
                      session_timeout=args.session_timeout, max_sessions=args.max_sessions,
                      max_model_len=args.max_model_len, tool_parser=args.tool_parser))


if __name__ == "__main__":
    main()
