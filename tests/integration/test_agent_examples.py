"""Every agent example's CPU config runs two async steps on a tiny random model.

The config is the shipped YAML (its agent, task, prompts, tools and export settings) with
only the model and the sizes overridden. A tiny model solves nothing, so rewards are ~0;
what is checked is that the whole pipeline runs: sessions through the proxy, tools, the
sandbox, trajectories, two optimiser steps. The online example also runs its own client,
a separate process that knows only the base_url and the admin key.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CPU_CONFIGS = sorted((REPO / "examples" / "agents").rglob("*_cpu.yaml"))
# Slow (make test-slow) to keep CI within its time: 45 s, a Python process per sample;
# test_agent_e2e.py runs a subprocess agent in CI.
# claude_code_cpu.yaml: 200 s here (a Claude Code process per session);
# test_claude_code.py runs its traffic checks in the default suite.
SLOW_EXAMPLES = {"multiturn_math_subprocess_cpu.yaml", "claude_code_cpu.yaml"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def _claude_installed() -> bool:
    local = REPO / "build" / "node" / "node_modules" / ".bin" / "claude"
    return bool(os.environ.get("CLAUDE_BIN") or shutil.which("claude") or local.exists())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_there_are_agent_examples():
    names = {p.parent.name for p in CPU_CONFIGS}
    assert {"multiturn_math", "online", "openai_agents"} <= names


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_EXAMPLES else p
    for p in CPU_CONFIGS], ids=lambda p: p.name)
def test_agent_example_runs_two_steps(path, tmp_path, tiny_model, monkeypatch):
    if path.parent.name == "claude_code" and not _claude_installed():
        pytest.skip("Claude Code is not installed: make agent-runtimes "
                    "(npm install @anthropic-ai/claude-code@2.1.332), or set $CLAUDE_BIN")
    monkeypatch.chdir(REPO)  # the configs name their agent files relative to the repository
    raw = yaml.safe_load(path.read_text())
    online = raw["agent"].get("mode") == "online"
    overrides = [
        f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={tiny_model}",
        "actor.dtype=float32", "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=12", "total_train_steps=2",
        "rollout.consumer_batch_size=2", "stats_logger.progress_bar=false",
        "stats_logger.plot=false", "stats_logger.tensorboard=false",
        "evaluator.before_training=false", "evaluator.after_training=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1", "agent.timeout=300",
    ]
    client = None
    if online:
        port = _free_port()
        overrides += [f"agent.port={port}", "agent.admin_key=admin-key-example"]
        client = subprocess.Popen(
            [sys.executable, str(REPO / "examples/agents/online/client.py"), "--base-url",
             f"http://127.0.0.1:{port}", "--admin-key", "admin-key-example",
             "--sessions", "100", "--concurrency", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    else:
        overrides += ["train_dataset.size=16", "train_dataset.batch_size=2"]
    try:
        cfg = load_config(path, overrides)
        summary = train(cfg)
    finally:
        if client is not None:
            out = client.communicate(timeout=120)[0]
            assert "Traceback" not in out, out
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["rollout/episodes_failed"] == 0
    assert rows[-1]["sessions/ended"] >= 2 * 2
    assert all(r["perf/trained_tokens"] > 0 for r in rows)
