"""OpenClaw's real traffic through the agent proxy: every request answered, every served
token captured, and two online RL steps. Skipped when OpenClaw or Node 24 is not installed
(make agent-runtimes)."""

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from asyncrl.agents.capture import export
from asyncrl.agents.proxy import AgentProxy
from asyncrl.api.types import GenerationResponse, StopReason
from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.inference.client.base import HTTPInferenceClient
from asyncrl.models.tiny import make_tiny_model, make_tiny_tokenizer
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "agents" / "openclaw"
_spec = importlib.util.spec_from_file_location("openclaw_client", EXAMPLE / "client.py")
oc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oc)
QUESTION = "What is 12 + 34? Give the final answer inside <answer></answer> tags."
STATUS_CALL = '<tool_call>\n{"name": "session_status", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def runtime():
    try:
        return oc.find_runtime(None, None)
    except oc.OpenClawError as e:
        pytest.skip(str(e))


class Scripted:
    """Answers request i with replies[i] (+ EOS); keeps what it served."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.served = tok, replies, []

    async def agenerate(self, req):
        ids = self.tok.encode(self.replies[min(len(self.served), len(self.replies) - 1)]) + \
            [self.tok.eos_token_id]
        self.served.append((list(req.input_ids), ids))
        return GenerationResponse(rid=req.rid, input_ids=list(req.input_ids), output_ids=ids,
                                  output_logprobs=[-0.01 * j for j in range(len(ids))],
                                  output_versions=[0] * len(ids), stop_reason=StopReason.STOP)


async def episode(runtime, tmp_path, replies, *, tools, max_model_len):
    tok = make_tiny_tokenizer()
    engine, seen = Scripted(tok, replies), []

    @web.middleware
    async def log(request, handler):
        body = await request.json() if request.can_read_body else None
        response = await handler(request)
        seen.append((request.method, request.path, response.status, body,
                     getattr(response, "body", None)))
        return response

    proxy = AgentProxy(engine, tok, "policy", admin_key="admin-key-oc",
                       max_model_len=max_model_len)
    build = proxy.app

    def app():
        a = build()
        a.middlewares.append(log)
        return a
    proxy.app = app
    await proxy.start()
    session = proxy.start_session(task_id="t", api_key="openclaw-key")
    config = tmp_path / "openclaw.json"
    config.write_text(json.dumps(oc.openclaw_config(
        proxy.base_url, "openclaw-key", context_window=max_model_len, max_tokens=512,
        tools=tools)))
    try:
        outcome = await oc.run_openclaw(*runtime, config, tmp_path, QUESTION, 120)
    except oc.OpenClawError as e:
        outcome = e
    await proxy.stop()
    return outcome, seen, session, engine


def test_openclaw_calls_a_tool_then_answers_and_every_served_token_is_captured(runtime,
                                                                            tmp_path):
    outcome, seen, session, engine = asyncio.run(episode(
        runtime, tmp_path, [STATUS_CALL, "12 + 34 = 46. <answer>46</answer>"],
        tools=oc.TOOLS, max_model_len=32_768))
    assert (outcome["status"], outcome["final"]) == ("ok", "12 + 34 = 46. <answer>46</answer>")
    # What OpenClaw sent with the example's settings: two streamed chat completions.
    assert [(m, p, st) for m, p, st, _, _ in seen] == [("POST", "/v1/chat/completions", 200)] * 2
    first, second = seen[0][3], seen[1][3]
    assert {k: first[k] for k in ("model", "stream", "stream_options", "tool_choice",
                                  "max_completion_tokens")} == {
        "model": "policy", "stream": True, "stream_options": {"include_usage": True},
        "tool_choice": "auto", "max_completion_tokens": 512}
    assert [t["function"]["name"] for t in first["tools"]] == ["session_status"]
    call, result = second["messages"][-2:]
    assert call["tool_calls"][0]["function"] == {"name": "session_status", "arguments": "{}"}
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    # The tool's answer reached the model, and the proxy kept exactly what it served.
    assert "Model: asyncrl/policy" in make_tiny_tokenizer().decode(engine.served[1][0])
    assert [(c.prompt_ids, c.output_ids) for c in session.completions] == engine.served
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    [traj] = out.trajectories
    assert (out.merged, out.drift) == (1, 0)
    prompt, last = engine.served[-1]
    assert traj.input_ids == prompt + last
    assert sum(traj.loss_mask) == sum(len(o) for _, o in engine.served)


def test_openclaws_default_request_overflows_8k_and_the_error_names_the_settings(runtime,
                                                                                tmp_path):
    outcome, seen, session, engine = asyncio.run(episode(
        runtime, tmp_path, ["never"], tools={}, max_model_len=8192))
    assert isinstance(outcome, oc.OpenClawError)
    assert all(s in str(outcome) for s in ("tools.profile", "tools.toolSearch", "TOOLS"))
    [(method, path, status, body, answer)] = seen
    assert (method, path, status, engine.served) == ("POST", "/v1/chat/completions", 400, [])
    assert len(body["tools"]) == 11  # OpenClaw's default surface: Tool Search and ten tools
    message = json.loads(answer)["error"]["message"]
    assert message.startswith("messages come to ") and "context is 8192 tokens" in message
    assert session.refused == [f"POST /v1/chat/completions 400: {message}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_online_rl_steps_train_on_exactly_the_tokens_openclaw_was_served(
        runtime, tmp_path, monkeypatch):
    served = []
    generate = HTTPInferenceClient.agenerate

    async def recorded(self, req):
        out = await generate(self, req)
        served.append((list(out.input_ids), list(out.output_ids)))
        return out
    monkeypatch.setattr(HTTPInferenceClient, "agenerate", recorded)
    model = make_tiny_model(tmp_path / "model", arch="llama", max_position_embeddings=16384)
    port, export_dir = _free_port(), tmp_path / "sessions"
    monkeypatch.chdir(REPO)
    client = subprocess.Popen(
        [sys.executable, str(EXAMPLE / "client.py"), "--base-url", f"http://127.0.0.1:{port}",
         "--admin-key", "admin-key-oc", "--sessions", "100", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the byte-level tiny tokenizer makes OpenClaw's prompt ~8.2k tokens
        cfg = load_config(EXAMPLE / "openclaw_cpu.yaml", [
            f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={model}",
            "actor.dtype=float32", "local_engine.dtype=float32", "local_engine.max_seq_len=16384",
            "actor.mb_spec.max_tokens_per_mb=16384", "local_engine.max_batch_size=16",
            "gconfig.max_new_tokens=12", "total_train_steps=2", "rollout.consumer_batch_size=2",
            "stats_logger.progress_bar=false", "stats_logger.plot=false",
            "stats_logger.tensorboard=false", "evaluator.before_training=false",
            "evaluator.after_training=false", "scheduler.inference_threads=1",
            "scheduler.trainer_threads=1", "scheduler.agent=inline",
            f"agent.port={port}", "agent.admin_key=admin-key-oc", f"agent.export_dir={export_dir}"])
        summary = train(cfg)
    finally:
        out = client.communicate(timeout=180)[0]
    assert "Traceback" not in out, out
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["rollout/episodes_failed"] == 0 and rows[-1]["sessions/ended"] >= 4
    assert all(r["perf/trained_tokens"] > 0 for r in rows)
    # Every completion the proxy recorded is token for token one the servers produced; the
    # only served answer it may lack is one in flight when training stopped (one session
    # runs at a time).
    sessions = [json.loads(x) for x in (export_dir / "sessions.jsonl").read_text().splitlines()]
    captured = [(c["prompt_ids"], c["output_ids"]) for s in sessions for c in s["completions"]]
    assert len(captured) >= 4 and all(c in served for c in captured)
    assert len(served) - len(captured) in (0, 1)
