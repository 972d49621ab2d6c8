"""Agent episodes: n sessions of an agent on one item, exported as one group of trajectories.

Each sample is a session of the agent proxy: the agent (inline function or command) gets
the proxy's base_url and the session's key, talks to the model however it likes, and
ends with a reward. The session's completions become trajectories (`agents/capture.py`),
all sharing the episode's group id, so GRPO's group baseline compares the n attempts.
A failing agent fails the episode (counted and reported by the rollout controller); an
agent that ends without a reward is an error, never a 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, Protocol

from asyncrl.agents.capture import ExportStyle, export
from asyncrl.agents.runner import AgentError, AgentFn
from asyncrl.agents.sandbox import isolation_seen
from asyncrl.agents.session import Session, SessionStatus
from asyncrl.agents.tools import ToolCache, group_cache
from asyncrl.api.protocols import InferenceEngine
from asyncrl.api.types import Trajectory
from asyncrl.controller.workflows.rlvr import gather_or_cancel

logger = logging.getLogger(__name__)
# Sessions the proxy ends on its own: their episode is dropped (counted by the proxy).
_DROPPED = (SessionStatus.VERSION_LAG, SessionStatus.TIMED_OUT)


class SessionDropped(Exception):
    """The proxy ended a session of the episode (version lag, idle timeout)."""


@dataclasses.dataclass(kw_only=True)
class AgentSpec:
    """How episodes are run and exported (the `agent:` config section, resolved)."""

    n_samples: int = 1
    timeout: float = 600.0  # seconds per session
    export_style: ExportStyle = "tree"
    turn_discount: float = 1.0
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # forced per request


class SessionHost(Protocol):
    """Where an episode's sessions live: the agent proxy in this process, or the agent
    service's client (agents/proxy.py `LocalSessions`, agents/service.py
    `AgentClient`)."""

    base_url: str  # what the agent is given (OpenAI-compatible, ends in /v1)

    async def open(self, *, task_id: str, sampling: dict[str, Any]) -> tuple[str, str]:
        """A new session already counted by the caller: (session id, its API key)."""
        ...

    async def close(self, session_id: str, *, reward: float | None = None,
                    failure: str | None = None) -> tuple[str, Session]:
        """End it (the proxy's `close_session`): (outcome, the ended session, completions
        included)."""
        ...

    def abandon(self, session_id: str, reason: str) -> None:
        """End it as failed without waiting (the episode was cancelled)."""
        ...


class AgentWorkflow:
    """`run(engine, item)`: the item's n sessions, concurrently, through `sessions`."""

    def __init__(self, sessions: SessionHost, agent: AgentFn, spec: AgentSpec) -> None:
        self.sessions, self.agent, self.spec = sessions, agent, spec
        self.counts = {"merged": 0, "drift": 0, "completions": 0}

    def for_eval(self, max_new_tokens: int | None = None) -> AgentWorkflow:
        """One greedy session per item, sharing the sessions and the agent."""
        sampling = {**self.spec.sampling, "temperature": 0.0}
        if max_new_tokens:
            sampling["max_new_tokens"] = max_new_tokens
        return AgentWorkflow(self.sessions, self.agent,
                             dataclasses.replace(self.spec, n_samples=1, sampling=sampling))

    def close(self) -> None:
        pass

    async def run(self, engine: InferenceEngine, item: dict[str, Any]) -> list[Trajectory] | None:
        """All samples' trajectories, in sample order (a sample may give several); None when
        the proxy ended a session (version lag, idle timeout): the episode is rejected, not
        failed, and its slot goes to a fresh one."""
        group_id = f"{item['id']}@{uuid.uuid4().hex[:12]}"
        token = group_cache.set(ToolCache())  # identical deterministic tool calls run once
        try:
            groups = await gather_or_cancel(*(self._sample(item, group_id, i)
                                              for i in range(self.spec.n_samples)))
        except SessionDropped as e:
            logger.info("episode of item %s dropped: %s", item["id"], e)
            return None
        finally:
            group_cache.reset(token)
        return [t for g in groups for t in g]

    async def _sample(self, item: dict[str, Any], group_id: str, index: int) -> list[Trajectory]:
        host = self.sessions
        sid, key = await host.open(task_id=str(item["id"]), sampling=self.spec.sampling)
        sandboxed: set[str] = set()
        isolation_seen.set(sandboxed)  # this task's context: what the agent's code ran under
        t0 = time.perf_counter()
        try:
            reward = await asyncio.wait_for(self.agent(host.base_url, key, item),
                                            self.spec.timeout)
        except asyncio.TimeoutError:
            await host.close(sid, failure="agent timed out")
            raise AgentError(f"agent did not finish within {self.spec.timeout:g} s "
                             f"(agent.timeout); session {sid}") from None
        except asyncio.CancelledError:
            host.abandon(sid, "the episode was cancelled")
            raise
        except Exception as e:
            _, session = await host.close(sid, failure=f"{type(e).__name__}: {e}")
            if session.status in _DROPPED:  # the proxy ended it; the agent saw a 409
                raise SessionDropped(f"session {sid} {session.status.value}: "
                                     f"{session.reason}") from e
            raise
        outcome, session = await host.close(sid, reward=None if reward is None else float(reward))
        if outcome == "no_completion":
            raise AgentError(f"agent returned reward {reward} but made no model call "
                             f"through the proxy (session {sid}: {session.reason})")
        if session.status is not SessionStatus.ENDED:  # ended from outside: not trainable
            raise SessionDropped(f"session {sid} {session.status.value}: {session.reason}")
        if not session.has_reward:
            raise AgentError(f"agent ended session {sid} without a reward: return one, "
                             "or POST /rl/set_reward before returning")
        return self.trajectories(session, group_id, item, index,
                                 episode_s=time.perf_counter() - t0,
                                 sandbox=sorted(sandboxed) if sandboxed else None)

    def trajectories(self, session: Session, group_id: str, item: dict[str, Any], index: int,
                     **extra: Any) -> list[Trajectory]:
        """The session's export, with what the trainer and the logs need in `meta`."""
        out = export(session.completions, style=self.spec.export_style,
                     discount=self.spec.turn_discount, group_id=group_id,
                     meta={"task_id": str(item["id"]), "session_id": session.id,
                           "sample_index": index, "question": item.get("question", ""),
                           "n_completions": len(session.completions),
                           "session_reward": _final_reward(session),
                           "completion": session.completions[-1].text, **extra})
        self.counts["merged"] += out.merged
        self.counts["drift"] += out.drift
        self.counts["completions"] += len(session.completions)
        return out.trajectories


def _final_reward(session: Session) -> float:
    return sum(c.reward or 0.0 for c in session.completions)
