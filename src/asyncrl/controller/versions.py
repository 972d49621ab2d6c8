"""Carrying each weight version from the trainer ranks to the servers, then announcing it.

A version is published (saved or sent by the trainer, loaded by every server) and then
announced: the agent service and the rollout learn it, and episodes of the new version may
start. With overlap (`actor.weight_update_overlap`, disk mode, the trainer inline) the
servers load on the rollout loop while the trainer trains the next step; a load may wait
for an evaluation that reads the weights the servers hold.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from asyncrl.agents.service import AgentServiceError
from asyncrl.controller.agents import AgentRuntime
from asyncrl.controller.supervise import Supervisor
from asyncrl.inference.client.base import WeightUpdateError

logger = logging.getLogger(__name__)


class VersionSync:
    """Publishes versions with `publisher` (a WeightPublisher, or the weight-update service's
    client) from `trainer`, and announces them to the rollout and the agents. A load that
    failed because servers died restarts them (`supervisor`) and loads once more."""

    def __init__(self, publisher: Any, trainer: Any, rollout: Any, supervisor: Supervisor,
                 agents: AgentRuntime | None = None, *, overlap: bool = False) -> None:
        self.publisher, self.trainer, self.rollout = publisher, trainer, rollout
        self.supervisor, self.agents, self.overlap = supervisor, agents, overlap
        self.version = 0  # the version the trainer's weights are at
        # the load still running (its version and future), and the timing of a load that
        # finished between steps, reported by the next `settle`
        self._loading: tuple[int, concurrent.futures.Future] | None = None
        self._load_stats: dict[str, float] = {}

    def publish(self, version: int, overlap: bool | None = None,
                after: concurrent.futures.Future | None = None) -> dict[str, float]:
        """Publish `version`: save it, have every server load it, announce it. With overlap
        the load and the announcement run on the rollout loop (`settle` waits for them);
        otherwise here. If the load failed because servers died, restart them and load once
        more (they come back at the previous version, then load this one).

        `after`: work that reads the weights the servers hold (an evaluation); the load
        starts when it has ended (however it ended)."""
        overlap = self.overlap if overlap is None else overlap
        self.version = version
        if not overlap:
            if after is not None:
                concurrent.futures.wait([after])
            try:
                stats = self.publisher.publish(self.trainer, version=version)
            except WeightUpdateError as e:
                if not self.supervisor.restart_dead_servers(checks=1):
                    raise
                logger.warning("weight update v%d failed (%s); restarted the dead servers, "
                               "publishing again", version, e)
                stats = self.publisher.publish(self.trainer, version=version)
            self.announce(version)
            return stats
        stats = self.publisher.save(self.trainer, version)

        async def load_and_announce() -> float:
            if after is not None:
                await asyncio.wait([asyncio.wrap_future(after)])
            t0 = time.monotonic()
            await self.publisher.load(version)
            if self.agents is not None:
                await self.agents.set_version(version)
            self.rollout.set_version(version)
            return time.monotonic() - t0

        self._loading = (version, self.rollout.submit_coroutine(load_and_announce()))
        return stats

    def settle(self) -> dict[str, float]:
        """Wait for the load of the last published version (if it still runs); the timing of
        the loads not reported yet (once per version)."""
        self.wait_loaded()
        stats, self._load_stats = self._load_stats, {}
        return stats

    def poll(self) -> None:
        """Settle a load that has finished (a failed one is dealt with: without it no episode
        of the new version starts); never waits."""
        if self._loading is not None and self._loading[1].done():
            self.wait_loaded()

    def wait_loaded(self) -> None:
        """Wait for the running load and announce its version; its timing is kept for the
        next `settle`. A failed load is handled as `publish` handles one."""
        if self._loading is None:
            return
        (version, future), self._loading = self._loading, None
        t0 = time.monotonic()
        try:
            self._load_stats["perf/weights_load_s"] = future.result()
            return
        except WeightUpdateError as e:
            if not self.supervisor.restart_dead_servers(checks=1):
                raise
            logger.warning("weight update v%d failed (%s); restarted the dead servers, "
                           "loading again", version, e)
            self.rollout.run_coroutine(self.publisher.load(version))
        except AgentServiceError:  # the servers hold it; the agent service could not learn it
            if not self.supervisor.restart_dead_agent_service(checks=1, version=version):
                raise
        self.announce(version)
        self._load_stats["perf/weights_load_s"] = time.monotonic() - t0

    def announce(self, version: int) -> None:
        """The servers hold `version` now: the agent service and the rollout learn it."""
        if self.agents is not None:
            try:
                self.rollout.run_coroutine(self.agents.set_version(version))
            except AgentServiceError:
                # a dead agent service learns the version when it is restarted
                if not self.supervisor.restart_dead_agent_service(checks=1, version=version):
                    raise
        self.rollout.set_version(version)

    def close(self) -> None:
        self.publisher.close()
