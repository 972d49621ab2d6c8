"""The agent side of an RL run (workflow.type=agent): the proxy, the agent, online admission.

The proxy serves on the rollout loop, so inline agents, the sessions they open and the
controller's episodes share one event loop; generation goes through the run's inference
client like every other episode.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.agents.drift import check_template_drift
from asyncrl.agents.export import SessionWriter
from asyncrl.agents.online import OnlineAdmission, TaskBaseline
from asyncrl.agents.runner import SubprocessAgent, resolve_agent
from asyncrl.agents.session import Session
from asyncrl.config import ExperimentConfig
from asyncrl.services.agent_proxy import AgentProxy
from asyncrl.workflows.agent import AgentSpec, AgentWorkflow

logger = logging.getLogger(__name__)


def forced_sampling(cfg: ExperimentConfig, eos_token_id: int | None) -> dict[str, Any]:
    """What every training session samples with, whatever the agent asks: the trainer's
    temperature (its log-probs assume it), top_p/top_k, and the token budget as a cap."""
    g = cfg.gconfig
    stops = list(g.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])
    return {"temperature": g.effective_temperature, "top_p": g.top_p, "top_k": g.top_k,
            "max_new_tokens": g.max_new_tokens, "stop_token_ids": stops}


class AgentRuntime:
    """Builds and runs the proxy and the agent workflow of `cfg`."""

    def __init__(self, cfg: ExperimentConfig, tokenizer: Any, engine: Any,
                 version: Any) -> None:
        a = cfg.agent
        self.cfg = cfg
        writer = (SessionWriter(a.export_dir, style=a.export_style, discount=a.turn_discount)
                  if a.export_dir else None)
        self.proxy = AgentProxy(
            engine, tokenizer, model_name=cfg.actor.path, admin_key=a.admin_key,
            version=version, session_timeout=a.session_timeout,
            max_session_version_lag=cfg.rollout.max_session_version_lag,
            max_model_len=cfg.local_engine.max_seq_len,
            sampling=forced_sampling(cfg, tokenizer.eos_token_id), on_end=writer,
            tool_parser=a.tool_parser)
        if a.mode == "subprocess":
            agent = SubprocessAgent(a.command, timeout=a.timeout)
        elif a.mode == "inline":
            agent = resolve_agent(a.fn)
        else:
            agent = _no_agent
        self.workflow = AgentWorkflow(self.proxy, agent, AgentSpec(
            n_samples=cfg.gconfig.n_samples, timeout=a.timeout, export_style=a.export_style,
            turn_discount=a.turn_discount))
        self.admission: OnlineAdmission | None = None
        report = check_template_drift(tokenizer, self.proxy.routes.native_tools)
        (logger.info if report.ok else logger.warning)("%s", report.describe())
        self.template_drift = report

    def attach(self, controller: Any) -> None:
        """Online mode: sessions started over HTTP become the controller's episodes."""
        if self.cfg.agent.mode != "online":
            return
        self.admission = OnlineAdmission(
            controller, self._online_trajectories,
            baseline=TaskBaseline() if self.cfg.agent.baseline else None)
        self.proxy.admission = self.admission

    def _online_trajectories(self, session: Session):
        item = {"id": session.task_id or session.id}
        return self.workflow.trajectories(session, session.id, item, 0)

    def stats(self) -> dict[str, float]:
        out = self.proxy.stats()
        out |= {f"agent/{k}": float(v) for k, v in self.workflow.counts.items()}
        if self.admission is not None:
            out |= {f"sessions/{k}": float(v) for k, v in self.admission.counts.items()}
        return out


async def _no_agent(base_url: str, api_key: str, item: dict) -> float | None:
    raise RuntimeError("agent.mode=online runs no agent itself: clients start sessions")
