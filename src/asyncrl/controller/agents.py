"""The agent side of an RL run (workflow.type=agent): the proxy, the agent, online admission.

The proxy runs in one of two places (`scheduler.agent`):
- inline: on the rollout loop of this process, so inline agents, the sessions they open and
  the controller's episodes share one event loop, and generation goes through the run's
  inference client like every other episode;
- service: in its own process (`agents/service.py`), started by the run's scheduler; the
  controller opens and closes sessions, and in online mode holds grants, over HTTP.
Either way the agents get an OpenAI base_url and a session key, and every completion comes
back token for token.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.agents.online import OnlineAdmission, TaskBaseline
from asyncrl.agents.proxy import LocalSessions
from asyncrl.agents.runner import SubprocessAgent, resolve_agent
from asyncrl.agents.service import AgentClient, AgentServiceError, AgentServiceSpec, build_proxy
from asyncrl.agents.session import Session
from asyncrl.controller.workflows.agent import AgentSpec, AgentWorkflow
from asyncrl.openai.drift import check_template_drift

logger = logging.getLogger(__name__)


class AgentRuntime:
    """Builds and runs the proxy (here, or the agent service's client) and the workflow."""

    def __init__(self, spec: AgentServiceSpec, tokenizer: Any, engine: Any, version: Any,
                 service: AgentClient | None = None) -> None:
        a = self.agent = spec.agent
        self.service = service
        self.proxy = None
        if service is None:
            self.proxy = build_proxy(spec, tokenizer, engine, version=version,
                                     admin_key=a.admin_key)
            sessions: Any = LocalSessions(self.proxy)
            report = check_template_drift(tokenizer, self.proxy.routes.native_tools)
            (logger.info if report.ok else logger.warning)("%s", report.describe())
        else:
            sessions = service  # the service checks the template in its own log
        if a.mode == "subprocess":
            agent = SubprocessAgent(a.command, timeout=a.timeout)
        elif a.mode == "inline":
            agent = resolve_agent(a.fn)
        else:
            agent = _no_agent
        self.workflow = AgentWorkflow(sessions, agent, AgentSpec(
            n_samples=spec.gconfig.n_samples, timeout=a.timeout, export_style=a.export_style,
            turn_discount=a.turn_discount))
        self.admission: OnlineAdmission | None = None
        self._controller: Any = None
        self._pump: asyncio.Task | None = None
        self._service_stats: dict[str, float] = {}

    def attach(self, controller: Any) -> None:
        """Online mode: sessions started over HTTP become the controller's episodes."""
        if self.agent.mode != "online":
            return
        self._controller = controller
        self.admission = OnlineAdmission(
            controller, self._online_trajectories,
            baseline=TaskBaseline() if self.agent.baseline else None)
        if self.proxy is not None:
            self.proxy.admission = self.admission

    async def start(self) -> str:
        """Serve the proxy (inline) or start holding online grants (service); its base_url."""
        if self.proxy is not None:
            return await self.proxy.start(self.agent.host, self.agent.port)
        if self.admission is not None:
            self._pump = asyncio.get_running_loop().create_task(self._grant_pump())
        return self.service.base_url

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        if self.proxy is not None:
            await self.proxy.stop()
        else:
            await self.service.close_client()

    async def set_version(self, version: int) -> None:
        """Tell the agent service the weight version now served (the inline proxy reads it)."""
        if self.service is not None:
            await self.service.set_version(version)

    async def replace_server(self, index: int, address: str) -> None:
        if self.service is not None:
            await self.service.replace_server(index, address)

    async def service_restarted(self, address: str, version: int,
                                servers: list[tuple[int, str]]) -> None:
        """The agent service runs again at `address`: sessions open there from now on; it
        learns the served `version` and the inference servers' current addresses."""
        self.service.move(address)
        await self.service.set_version(version)
        for index, server in servers:
            await self.service.replace_server(index, server)

    async def _grant_pump(self) -> None:
        """Keep one open grant per session the staleness bound allows now (service, online).

        A grant is an episode of the controller from the moment it is counted; a client's
        session fills the oldest grant; a grant no client took within its timeout ends as
        a rejected episode and frees its slot for a fresh one."""
        while True:
            while self._controller.start_external(self._grant) is not None:
                pass
            await asyncio.sleep(0.2)

    def _grant(self, version: int):
        async def run():
            try:
                session = await self.service.await_session(version)
            except AgentServiceError as e:
                logger.warning("online grant at version %d failed: %s", version, e)
                await asyncio.sleep(1.0)  # the service is restarting or gone; do not spin
                return None
            return None if session is None else self.admission.outcome(session)
        return _GrantHandle(f"grant-v{version}"), run

    def _online_trajectories(self, session: Session):
        item = {"id": session.task_id or session.id}
        return self.workflow.trajectories(session, session.id, item, 0)

    async def refresh_stats(self) -> None:
        if self.service is not None:
            try:
                self._service_stats = await self.service.stats()
            except AgentServiceError as e:
                logger.warning("%s", e)

    def stats(self) -> dict[str, float]:
        out = self.proxy.stats() if self.proxy is not None else dict(self._service_stats)
        out |= {f"agent/{k}": float(v) for k, v in self.workflow.counts.items()}
        if self.admission is not None:
            out |= {f"sessions/{k}": float(v) for k, v in self.admission.counts.items()}
        return out


class _GrantHandle:
    def __init__(self, id: str) -> None:
        self.id = id


async def _no_agent(base_url: str, api_key: str, item: dict) -> float | None:
    raise RuntimeError("agent.mode=online runs no agent itself: clients start sessions")
