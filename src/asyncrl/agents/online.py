"""Online RL: sessions that outside clients start are the trainer's episodes.

A client (a person, a deployed agent, another machine) knows only the proxy's base_url
and the admin key. `POST /rl/start_session` asks `OnlineAdmission.admit`, which starts an
episode in the rollout controller if the staleness rule allows one now (else the client
gets 429 + Retry-After). The episode awaits the session's end; a session that ended with a
reward becomes its trajectories, anything else (timed out, version lag, no reward) is
rejected, which frees its slot, and is counted by the proxy.

Each online session is its own group, so a group baseline would make every advantage 0.
`TaskBaseline` subtracts instead the running mean reward of earlier sessions of the same
task (of all tasks while a task has none yet); the raw reward stays in `meta`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from asyncrl.agents.session import Session, SessionStatus
from asyncrl.api.types import Trajectory

logger = logging.getLogger(__name__)


class TaskBaseline:
    """Running mean reward per task id (and over all tasks), updated after use."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def baseline(self, task: str) -> float:
        if self.counts[task]:
            return self.sums[task] / self.counts[task]
        n = sum(self.counts.values())
        return sum(self.sums.values()) / n if n else 0.0

    def update(self, task: str, reward: float) -> None:
        self.sums[task] += reward
        self.counts[task] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = defaultdict(float, state["sums"])
        self.counts = defaultdict(int, state["counts"])


class OnlineAdmission:
    """The proxy's admission in online training: one controller episode per session."""

    def __init__(self, controller: Any, to_trajectories: Callable[[Session], list[Trajectory]],
                 *, baseline: TaskBaseline | None = None) -> None:
        self.controller = controller
        self.to_trajectories = to_trajectories
        self.baseline = baseline
        self.counts = {"no_reward": 0}

    def admit(self, start: Callable[[int], Session]) -> Session | None:
        def make(version: int):
            session = start(version)
            return session, lambda: self._finish(session)
        return self.controller.start_external(make)

    async def _finish(self, session: Session) -> list[Trajectory] | None:
        await session.done
        return self.outcome(session)

    def outcome(self, session: Session) -> list[Trajectory] | None:
        """An ended session's trajectories (baseline subtracted), or None: not trainable."""
        if session.status is not SessionStatus.ENDED:
            return None  # counted by the proxy under its status, and logged there
        if not session.has_reward or not session.completions:
            self.counts["no_reward"] += 1
            logger.warning("session %s (task %s) ended without a reward; not trained",
                           session.id, session.task_id)
            return None
        trajectories = self.to_trajectories(session)
        if self.baseline is not None:
            task = session.task_id or ""
            b = self.baseline.baseline(task)
            for t in trajectories:
                t.meta.update(raw_reward=t.reward, baseline=b)
                t.reward -= b
            self.baseline.update(task, sum(t.meta["raw_reward"] for t in trajectories)
                                 / len(trajectories))
        return trajectories
