"""Every agent example's CPU config runs two async steps on a tiny random model.

The config is the shipped YAML (its agent, task, prompts, tools and export settings) with
only the model and the sizes overridden. A tiny model solves nothing, so rewards are ~0;
what is checked is that the whole pipeline runs: sessions through the proxy, tools, the
sandbox, trajectories, two optimiser steps. The online example also runs its own client,
a separate process that knows only the base_url and the admin key.
"""

import json
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
from asyncrl.inference.client.base import HTTPInferenceClient
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# openclaw_cpu.yaml runs its two steps in test_openclaw.py, which also checks every recorded
# token against the served ones.
CPU_CONFIGS = sorted(p for p in (REPO / "examples" / "agents").rglob("*_cpu.yaml")
                     if p.name != "openclaw_cpu.yaml")
# Slow (make test-slow) to keep CI within its time: 45 s, a Python process per sample;
# test_agent_e2e.py runs a subprocess agent in CI. Customer service: 90 s (up to six agent
# calls and three customer calls per session, on prompts of ~2100 tiny-tokenizer tokens);
# tests/unit/agents/test_customer_service.py runs its agent through the proxy in CI.
# hermes_cpu.yaml: a Hermes process per session, each prompt ~6k tokens of the tiny model.
# camel_cpu.yaml: a CAMEL process per session (~3 s of imports each).
# claude_code_cpu.yaml: 200 s (a Claude Code process per session); test_claude_code.py
# runs its traffic checks in the default suite. swe_cpu.yaml: 15 s;
# tests/unit/agents/test_swe_task.py runs mini-swe-agent on the task over a scripted model.
SLOW_EXAMPLES = {"multiturn_math_subprocess_cpu.yaml", "hermes_cpu.yaml", "camel_cpu.yaml",
                 "customer_service_cpu.yaml", "claude_code_cpu.yaml", "swe_cpu.yaml"}
# Runtimes that live in their own environment (they pin packages the project's extras
# cannot share): found on PATH or under the repository's .venv-<name>.
HERMES = os.environ.get("ASYNCRL_HERMES") or shutil.which("hermes") or \
    str(REPO / ".venv-hermes" / "bin" / "hermes")
CAMEL_PYTHON = os.environ.get("ASYNCRL_CAMEL_PYTHON") or str(REPO / ".venv-camel" / "bin" / "python")
# Runtimes written elsewhere whose recorded completions are checked token for token
# against what the servers served (OpenClaw's and Claude Code's are in their own files).
TOKEN_CHECKED = {"camel", "hermes"}


def _has_camel(python: str) -> bool:
    if python == "python":
        python = sys.executable
    return Path(python).is_file() and subprocess.run(
        [python, "-c", "import camel.agents"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # 4096 positions: the customer-service prompt (policy and four tools) alone is ~2100
    # characters, and the tiny tokenizer has one token per character.
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama",
                           max_position_embeddings=4096)


def _claude_installed() -> bool:
    local = REPO / "build" / "node" / "node_modules" / ".bin" / "claude"
    return bool(os.environ.get("CLAUDE_BIN") or shutil.which("claude") or local.exists())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_there_are_agent_examples():
    names = {p.parent.name for p in CPU_CONFIGS}
    assert {"multiturn_math", "online", "openai_agents", "hermes", "camel"} <= names


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
    if path.parent.name == "camel":
        if not _has_camel(CAMEL_PYTHON):
            pytest.skip("CAMEL is not installed: python -m venv .venv-camel && "
                        ".venv-camel/bin/pip install camel-ai==0.2.90 'mcp<2' "
                        "(or set ASYNCRL_CAMEL_PYTHON to an interpreter that has it)")
        monkeypatch.setenv("ASYNCRL_CAMEL_PYTHON", CAMEL_PYTHON)
    served = []
    if path.parent.name in TOKEN_CHECKED:
        generate = HTTPInferenceClient.agenerate

        async def recorded(self, req):
            out = await generate(self, req)
            served.append((list(out.input_ids), list(out.output_ids)))
            return out
        monkeypatch.setattr(HTTPInferenceClient, "agenerate", recorded)
        overrides.append(f"agent.export_dir={tmp_path / 'sessions'}")
    client = None
    if online:
        port = _free_port()
        overrides += [f"agent.port={port}", "agent.admin_key=admin-key-example"]
        command = [sys.executable, str(path.parent / "client.py"), "--base-url",
                   f"http://127.0.0.1:{port}", "--admin-key", "admin-key-example",
                   "--sessions", "100"]
        if path.parent.name == "hermes":
            if not Path(HERMES).is_file():
                pytest.skip("Hermes Agent is not installed: python -m venv .venv-hermes && "
                            ".venv-hermes/bin/pip install hermes-agent==0.19.0 "
                            "(or set ASYNCRL_HERMES to its hermes executable)")
            # the byte-level tiny tokenizer makes Hermes' prompt ~6k tokens
            overrides += ["local_engine.max_seq_len=16384"]
            command += ["--hermes", HERMES, "--timeout", "120"]
        else:
            command += ["--concurrency", "2"]
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
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
    if path.parent.name in TOKEN_CHECKED:
        # Every completion the proxy recorded is, token for token, one the servers produced
        # (answers still in flight when training stopped may be missing, never altered).
        sessions = [json.loads(line) for line in
                    (tmp_path / "sessions" / "sessions.jsonl").read_text().splitlines()]
        captured = [(c["prompt_ids"], c["output_ids"])
                    for session in sessions for c in session["completions"]]
        assert len(captured) >= 4 and all(c in served for c in captured)
