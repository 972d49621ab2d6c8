"""Agent sessions: who may generate under which key, what each one generated, how it ended.

A session is one episode of an agent: it gets its own API key, records every completion
made with that key (see `capture.py`), collects rewards, and ends exactly once with a
status. Ending resolves `session.done`, which whoever started the session awaits (an
agent workflow, the online source of the trainer, or the exporter of `asyncrl serve`).

The store is used from one event loop (the proxy's) only, so it needs no locks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.capture import Completion

logger = logging.getLogger(__name__)


_MAX_REFUSED = 4


class SessionStatus(str, enum.Enum):
    ACTIVE = "active"
    ENDED = "ended"  # ended by its agent (end_session, a new session on its key, agent returned)
    TIMED_OUT = "timed_out"  # no request for `session_timeout` seconds
    VERSION_LAG = "version_lag"  # fell more than max_session_version_lag versions behind
    FAILED = "failed"  # its agent raised or exited non-zero
    CANCELLED = "cancelled"  # the proxy shut down while it was active


LOST = ("{what} began on an agent proxy that has restarted since: it is lost, and none of "
        "it is trained; start a new session")


class SessionError(Exception):
    """A session operation that cannot be done; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True)
class Session:
    id: str
    api_key: str
    task_id: str | None = None
    start_version: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)  # overrides of request sampling
    completions: list[Completion] = field(default_factory=list)
    status: SessionStatus = SessionStatus.ACTIVE
    reason: str = ""  # why it ended, in words
    # The last few generation requests the proxy refused ("POST /v1/messages 400: ..."), so
    # that a session which never got an answer says why (e.g. a prompt the context cannot hold)
    refused: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    inflight: int = 0  # requests being answered now (an idle timeout waits for them)
    retry_cache: dict[str, list[asyncio.Future]] = field(default_factory=dict)
    done: asyncio.Future | None = None

    @property
    def active(self) -> bool:
        return self.status is SessionStatus.ACTIVE

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def set_reward(self, reward: float, completion_id: str | None = None) -> Completion:
        """Give `reward` to a completion (default: the last one)."""
        if not self.active:
            raise SessionError(f"session {self.id} is {self.status.value}; a reward can only be "
                               "set while it is active", status=409)
        if not self.completions:
            raise SessionError(f"session {self.id} has no completion to reward yet", status=409)
        if completion_id is None:
            target = self.completions[-1]
        else:
            target = next((c for c in self.completions if c.id == completion_id), None)
            if target is None:
                raise SessionError(f"session {self.id} has no completion {completion_id!r}",
                                   status=404)
        target.reward = float(reward)
        return target

    def note_refused(self, what: str) -> None:
        """Keep a refused request's answer (the last `_MAX_REFUSED`)."""
        self.refused = [*self.refused, what][-_MAX_REFUSED:]

    @property
    def has_reward(self) -> bool:
        return any(c.reward is not None for c in self.completions)

    def to_record(self) -> dict[str, Any]:
        """The session as JSON with its completions (what a remote workflow exports)."""
        return {"session_id": self.id, "task_id": self.task_id, "status": self.status.value,
                "reason": self.reason, "start_version": self.start_version,
                "refused": list(self.refused),
                "completions": [c.to_dict() for c in self.completions]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Session:
        """An ended session rebuilt from `to_record` (no key, no future: a read-only copy)."""
        return cls(id=record["session_id"], api_key="", task_id=record["task_id"],
                   start_version=record["start_version"],
                   status=SessionStatus(record["status"]), reason=record["reason"],
                   refused=list(record.get("refused", [])),
                   completions=[Completion.from_dict(c) for c in record["completions"]])

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.id, "task_id": self.task_id, "status": self.status.value,
                "reason": self.reason, "n_completions": len(self.completions),
                "refused": list(self.refused),
                "start_version": self.start_version,
                "rewards": [c.reward for c in self.completions],
                "age_s": round(time.monotonic() - self.created, 3)}


# Ids and generated keys carry the store's instance tag, so that a proxy that restarted can
# tell a session it never knew from one its previous process had (and lost).
_TAGGED = re.compile(r"^(?:sess|sk-asyncrl)-([0-9a-f]{8})-")


class SessionStore:
    """Sessions by id and by key; keys bind to one session at a time."""

    def __init__(self, *, on_end: Callable[[Session], None] | None = None) -> None:
        self.instance = secrets.token_hex(4)  # new in every proxy process
        self.by_id: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.on_end = on_end
        self.counts = {status.value: 0 for status in SessionStatus if status is not
                       SessionStatus.ACTIVE} | {"started": 0}

    def start(self, *, task_id: str | None = None, api_key: str | None = None,
              start_version: int = 0,
              sampling: dict[str, Any] | None = None) -> Session:
        """A new active session; a key already bound ends (and exports) its old session."""
        if api_key is not None and (not isinstance(api_key, str) or len(api_key) < 8):
            raise SessionError("api_key must be a string of at least 8 characters", status=400)
        if api_key is not None and api_key in self.by_key:
            old = self.by_key[api_key]
            self.end(old, SessionStatus.ENDED, "its key started a new session")
        session = Session(id=f"sess-{self.instance}-{uuid.uuid4().hex[:16]}",
                          api_key=api_key or f"sk-asyncrl-{self.instance}-"
                                             f"{secrets.token_urlsafe(24)}",
                          task_id=task_id, start_version=start_version,
                          sampling=dict(sampling or {}))
        session.done = asyncio.get_running_loop().create_future()
        self.by_id[session.id] = session
        self.by_key[session.api_key] = session
        self.counts["started"] += 1
        return session

    def by_api_key(self, key: str) -> Session | None:
        return self.by_key.get(key)

    def get(self, session_id: str) -> Session:
        session = self.by_id.get(session_id)
        if session is None and self.from_earlier_proxy(session_id):
            raise SessionError(LOST.format(what=f"session {session_id}"), status=410)
        if session is None:
            raise SessionError(f"unknown session {session_id!r}", status=404)
        return session

    def from_earlier_proxy(self, key_or_id: str) -> bool:
        """Whether a session id or generated key was issued by another proxy process (one
        that this one replaced: its sessions are gone)."""
        match = _TAGGED.match(key_or_id)
        return match is not None and match.group(1) != self.instance

    def end(self, session: Session, status: SessionStatus, reason: str = "") -> bool:
        """End `session` once with `status` (False if it had already ended)."""
        if not session.active:
            return False
        session.status, session.reason = status, reason
        if self.by_key.get(session.api_key) is session:
            del self.by_key[session.api_key]
        self.counts[status.value] += 1
        if status is not SessionStatus.ENDED:
            logger.warning("session %s (task %s) %s: %s", session.id, session.task_id,
                           status.value, reason)
        if session.done is not None and not session.done.done():
            session.done.set_result(session)
        if self.on_end is not None:
            self.on_end(session)
        return True

    def forget(self, session: Session) -> None:
        """Drop an ended session's record (its key was released when it ended)."""
        self.by_id.pop(session.id, None)

    def active(self) -> list[Session]:
        return [s for s in self.by_id.values() if s.active]

    def expire(self, timeout: float) -> list[Session]:
        """End the sessions idle for longer than `timeout` seconds (none with requests in flight)."""
        now = time.monotonic()
        stale = [s for s in self.active() if s.inflight == 0 and now - s.last_active > timeout]
        for s in stale:
            self.end(s, SessionStatus.TIMED_OUT,
                     f"no request for {now - s.last_active:.0f} s (session_timeout={timeout:g} s)")
        return stale
