"""Keeping an RL run's processes alive: health checks, restarts, and the error that stops it.

An inference server or the agent service that fails its health checks is restarted by the
run's scheduler; a server that dies again of the error it died of before stops the run with
that error instead of being restarted for ever.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.controller.agents import AgentRuntime
from asyncrl.launch.base import (
    Scheduler,
    SchedulerError,
    WorkerDiedError,
    cause_line,
    log_size,
    log_tail,
)

logger = logging.getLogger(__name__)
# The processes an RL run's scheduler starts.
ROLES = ("inference", "router", "trainer", "weight_update", "agent")


class Supervisor:
    """Restarts the run's inference servers and agent service when they fail health checks.

    `engine` is the controller's inference client (its server list is updated on a restart),
    `rollout` the rollout controller (its loop runs the client's coroutines), `agents` the
    agent runtime of an agent run, `routed` whether a router service routes for every client.
    Without a scheduler nothing is restarted.
    """

    def __init__(self, scheduler: Scheduler | None, engine: Any, rollout: Any,
                 agents: AgentRuntime | None = None, *, routed: bool = False,
                 backend: str = "local") -> None:
        self.scheduler, self.engine, self.rollout, self.agents = scheduler, engine, rollout, agents
        self.routed, self.backend = routed, backend
        self.server_restarts = 0
        self.agent_service_restarts = 0
        # server index (or "agent", the agent service) -> health checks failed in a row
        self._failed_checks: dict[int | str, int] = {}
        # server index -> the error that ended its last life, and where its log's part for
        # the present life begins (restarts append to the same file)
        self._death_causes: dict[int, str | None] = {}
        self._log_starts: dict[int, int] = {}

    def stats(self) -> dict[str, float]:
        """The run's restart counts, for the step's stats."""
        stats = {"inference/server_restarts": float(self.server_restarts)}
        if self.agents is not None and self.agents.service is not None:
            stats["agent/service_restarts"] = float(self.agent_service_restarts)
        return stats

    def restart_dead(self) -> None:
        """The inference servers and the agent service that failed two health checks in a
        row, restarted."""
        self.restart_dead_servers()
        self.restart_dead_agent_service(checks=2)

    def restart_dead_servers(self, checks: int = 2) -> int:
        """Restart each inference server that failed its health check `checks` times in a
        row (its process dead, or alive but not answering); it rejoins routing once it
        holds the current weights (the client re-syncs it). Returns how many this call
        restarted (`server_restarts` counts the run's)."""
        if self.scheduler is None:
            return 0
        restarted = 0
        for idx, ok in enumerate(self.scheduler.check_health("inference")):
            self._failed_checks[idx] = 0 if ok else self._failed_checks.get(idx, 0) + 1
            if self._failed_checks[idx] < checks:
                continue
            self._check_new_death(idx)
            logger.warning("inference server %d failed %s; restarting it (%s)", idx,
                           {1: "a health check", 2: "two health checks"}.get(
                               checks, f"{checks} health checks"),
                           self._death_causes[idx] or "no error in its log")
            restarted += 1
            self._log_starts[idx] = log_size(self.scheduler.get_workers("inference")[idx].log_path)
            worker = self.scheduler.restart_worker("inference", idx)
            if worker.address != self.engine.addresses[idx]:
                self.engine.replace_server(idx, worker.address)
            self._failed_checks[idx] = 0
            self.server_restarts += 1
            self.rollout.run_coroutine(self.engine.check_servers())
            if self.agents is not None and not self.routed:  # the agent service's own client
                self.rollout.run_coroutine(self.agents.replace_server(idx, worker.address))
        return restarted

    def _check_new_death(self, idx: int) -> None:
        """Record why inference server `idx` died (the first error in its log since it last
        started); WorkerDiedError if that is why it died the time before: a server that
        fails the same way on every start (a backend bug, a bad flag, a model it cannot
        load) stops the run with its cause."""
        worker = self.scheduler.get_workers("inference")[idx]
        cause = cause_line(worker.log_path, self._log_starts.get(idx, 0))
        if cause is not None and cause == self._death_causes.get(idx):
            raise WorkerDiedError(
                f"inference server {idx} ({worker.address}, backend {self.backend}) "
                f"died again the way it died before: {cause}\n"
                f"Its log: {worker.log_path} (the error from its previous start is there too)")
        self._death_causes[idx] = cause

    def restart_dead_agent_service(self, checks: int, version: int | None = None) -> int:
        """Restart the agent service (scheduler.agent=service) once it failed `checks` health
        checks in a row. Its sessions in flight died with it: their agents' calls fail (the
        new process answers their keys 410 session_lost) and closing them fails, so each
        such episode fails, is reported in failures.jsonl and runs again
        (rollout.episode_retries); nothing of them is trained. The new process is told the
        served weight version (`version`, default the rollout's) and the servers' addresses
        before it opens a session."""
        if self.scheduler is None or self.agents is None or self.agents.service is None:
            return 0
        ok = all(self.scheduler.check_health("agent"))
        self._failed_checks["agent"] = 0 if ok else self._failed_checks.get("agent", 0) + 1
        if self._failed_checks["agent"] < checks:
            return 0
        logger.warning("the agent service failed %d health check(s); restarting it (its "
                       "sessions in flight are lost and their episodes run again)", checks)
        worker = self.scheduler.restart_worker("agent", 0)
        self._failed_checks["agent"] = 0
        self.agent_service_restarts += 1
        servers = [] if self.routed else list(enumerate(self.engine.addresses))
        self.rollout.run_coroutine(self.agents.service_restarted(
            worker.address, self.rollout.version if version is None else version, servers))
        return 1

    def raise_if_dead(self) -> None:
        """SchedulerError for the first of the run's processes that is down, with the first
        error of its present life and its log's tail (a dead process explains a failed
        rollout or training call best)."""
        if self.scheduler is None:
            return
        for role in ROLES:
            workers = self.scheduler.get_workers(role)
            for worker, ok in zip(workers, self.scheduler.check_health(role) if workers else []):
                if ok:
                    continue
                start = self._log_starts.get(worker.index, 0) if role == "inference" else 0
                cause = cause_line(worker.log_path, start)
                raise SchedulerError(f"{role} {worker.index} ({worker.address}) is down"
                                     + (f": {cause}" if cause else "") + "; the end of "
                                     f"{worker.log_path}:\n{log_tail(worker.log_path)}")
