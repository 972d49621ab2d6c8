"""A run's timeline: when each process generated, trained, published, loaded weights or waited.

`Timeline` appends one JSON line per finished span to <run>/timeline.jsonl:
{"lane": "trainer" | "server 0" | ..., "kind": "train" | "generate" | ..., "t0", "t1"}
(wall-clock seconds). The trainer's lane comes from the step's sections; a server's
lane from the client that routes to it: "generate" while it has requests in flight,
"load weights" while it pauses, loads and resumes; the evaluator's lane holds each
held-out evaluation (the first one runs beside the first step). `plot_timeline` draws it as
<run>/timeline.png, one row per lane, with each lane's busy share, so the overlap that
asynchrony buys, and where a core idles, can be seen step by step.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COLORS = {"train": "tab:blue", "generate": "tab:green", "publish": "tab:orange",
          "load weights": "tab:red", "eval": "tab:purple", "wait": "0.85"}
IDLE_KINDS = {"wait"}  # spans that are not work (busy shares leave them out)


class Timeline:
    """Spans of work per lane, appended to a JSONL file as they end (thread-safe)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], float] = {}

    def begin(self, lane: str, kind: str) -> None:
        """Start a span (a second begin of an open span is ignored)."""
        with self._lock:
            self._open.setdefault((lane, kind), time.time())

    def end(self, lane: str, kind: str) -> None:
        """End the open span of (lane, kind), if any, and write it."""
        with self._lock:
            t0 = self._open.pop((lane, kind), None)
            if t0 is not None:
                self._write(lane, kind, t0, time.time())

    @contextlib.contextmanager
    def span(self, lane: str, kind: str) -> Iterator[None]:
        """The block as one span of `lane`."""
        t0 = time.time()
        try:
            yield
        finally:
            self.add(lane, kind, t0, time.time())

    def add(self, lane: str, kind: str, t0: float, t1: float) -> None:
        """A span measured elsewhere (wall-clock seconds)."""
        with self._lock:
            self._write(lane, kind, t0, t1)

    def _write(self, lane: str, kind: str, t0: float, t1: float) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"lane": lane, "kind": kind, "t0": round(t0, 4),
                                "t1": round(t1, 4)}) + "\n")


def read_timeline(path: str | Path) -> list[dict[str, Any]]:
    """The spans of a timeline.jsonl (a torn last line, from a killed run, is skipped)."""
    spans = []
    for line in Path(path).read_text().splitlines():
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return spans


def busy_shares(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Per lane, the share of the whole timeline it spent in work (overlaps merged)."""
    if not spans:
        return {}
    start = min(s["t0"] for s in spans)
    total = max(s["t1"] for s in spans) - start
    out = {}
    for lane in _lanes(spans):
        work = sorted((s["t0"], s["t1"]) for s in spans
                      if s["lane"] == lane and s["kind"] not in IDLE_KINDS)
        covered, reach = 0.0, float("-inf")
        for t0, t1 in work:
            if t1 > reach:
                covered += t1 - max(t0, reach)
                reach = t1
        out[lane] = covered / total if total > 0 else 0.0
    return out


def _lanes(spans: list[dict[str, Any]]) -> list[str]:
    lanes = sorted({s["lane"] for s in spans}, key=lambda lane: (lane != "trainer", lane))
    return lanes


def plot_timeline(path: str | Path, out_path: str | Path, *, title: str = "") -> Path:
    """timeline.png: one row per lane, a bar per span coloured by kind, busy shares named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = read_timeline(path)
    lanes = _lanes(spans)
    start = min((s["t0"] for s in spans), default=0.0)
    shares = busy_shares(spans)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * max(len(lanes), 1)))
    for row, lane in enumerate(lanes):
        for kind in {s["kind"] for s in spans if s["lane"] == lane}:
            bars = [(s["t0"] - start, s["t1"] - s["t0"]) for s in spans
                    if s["lane"] == lane and s["kind"] == kind]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=COLORS.get(kind, "tab:gray"))
    ax.set_yticks(range(len(lanes)),
                  [f"{lane} ({shares[lane]:.0%} busy)" for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first span")
    kinds = sorted({s["kind"] for s in spans})
    ax.legend(handles=[Patch(color=COLORS.get(k, "tab:gray"), label=k) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(lanes) < 3 else -0.2),
              ncol=len(kinds), frameon=False)
    ax.set_title(title or "timeline")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return Path(out_path)
