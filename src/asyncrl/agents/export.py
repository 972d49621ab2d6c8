"""Finished sessions as JSONL: for inspection, SFT data or offline RL.

    <dir>/sessions.jsonl      one row per session: id, task, status, reason, every
                              completion (prompt/output ids, log-probs, versions, text,
                              reward, the request's messages and tools)
    <dir>/trajectories.jsonl  one row per trajectory of a session that has completions:
                              input_ids, loss_mask, logprobs, versions, reward (null when
                              the session got none), the session's status, the messages

Every session is written whatever its status (timed out, version lag, no reward): nothing
is lost, and the status says whether it is fit to train on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from asyncrl.agents.capture import ExportStyle, export
from asyncrl.agents.session import Session

logger = logging.getLogger(__name__)


class SessionWriter:
    """Appends each finished session to `<dir>/sessions.jsonl` and `trajectories.jsonl`."""

    def __init__(self, directory: str | Path, *, style: ExportStyle = "tree",
                 discount: float = 1.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.style, self.discount = style, discount
        self.n_sessions = self.n_trajectories = 0

    def __call__(self, session: Session) -> None:
        with open(self.dir / "sessions.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(session_row(session)) + "\n")
        self.n_sessions += 1
        if not session.completions:
            return
        rows = trajectory_rows(session, style=self.style, discount=self.discount)
        with open(self.dir / "trajectories.jsonl", "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self.n_trajectories += len(rows)


def session_row(session: Session) -> dict[str, Any]:
    return {**session.summary(), "completions": [c.to_dict() for c in session.completions]}


def trajectory_rows(session: Session, *, style: ExportStyle,
                    discount: float) -> list[dict[str, Any]]:
    """The session's trajectories as plain rows (reward null when it got none)."""
    out = export(session.completions, style=style, discount=discount, group_id=session.id)
    by_id = {c.id: c for c in session.completions}
    rows = []
    for t in out.trajectories:
        leaf = by_id[t.meta["completion_ids"][-1]]
        messages = list(leaf.request.get("messages", []))
        rows.append({
            "session_id": session.id, "task_id": session.task_id,
            "status": session.status.value,
            "reward": t.reward if session.has_reward else None,
            "input_ids": t.input_ids, "loss_mask": t.loss_mask,
            "logprobs": t.behavior_logprobs, "versions": t.versions,
            "completion_ids": t.meta["completion_ids"], "turn_spans": t.meta["turn_spans"],
            "drift": t.meta["drift"], "stop_reason": t.stop_reason.value,
            "messages": messages + [{"role": "assistant", "content": leaf.text}],
            "tools": leaf.request.get("tools"),
        })
    return rows
