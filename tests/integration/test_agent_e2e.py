"""Agent workflows end to end on a tiny model: inline, subprocess and online, 2 steps each."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import tiny_run_config

from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def _train_rows(summary):
    rows = read_stats(Path(summary["run_dir"]) / "stats.jsonl")
    return [r for r in rows if r["kind"] == "train"]


def test_inline_two_turn_agent_trains_on_merged_conversations(tmp_path, tiny_model):
    export = tmp_path / "sessions"
    cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent",
                          "agent.fn=toy_agents:two_turns", f"agent.export_dir={export}",
                          "evaluator.after_training=true",
                          "valid_dataset.path=reasoning_gym:basic_arithmetic",
                          "valid_dataset.size=2", "valid_dataset.seed=99", name="agent-inline")
    summary = train(cfg)
    rows = _train_rows(summary)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["agent/completions"] > 0 and rows[-1]["sessions/ended"] > 0
    assert rows[0]["train/grad_norm"] > 0
    assert 0.0 <= summary["eval_after"] <= 1.0
    # Every session is written: those that finished (training and evaluation) with both
    # completions, those still running when training stopped as cancelled.
    sessions = [json.loads(x) for x in (export / "sessions.jsonl").read_text().splitlines()]
    ended = [s for s in sessions if s["status"] == "ended"]
    assert len(ended) >= 2 * 2 * 2 + 2 and all(len(s["completions"]) == 2 for s in ended)
    assert {s["status"] for s in sessions} <= {"ended", "cancelled"}
    # Each second turn merged into its first (one trajectory), or drifted (two).
    ids = {s["session_id"] for s in ended}
    trajs = [json.loads(x) for x in (export / "trajectories.jsonl").read_text().splitlines()]
    trajs = [t for t in trajs if t["session_id"] in ids]
    assert len(trajs) == len(ended) + sum(t["drift"] for t in trajs)
    for t in trajs:  # every row's loss mask covers exactly its sampled spans
        assert sum(t["loss_mask"]) == sum(b - a for a, b in t["turn_spans"])
        assert len(t["turn_spans"]) == (1 if t["drift"] or len(t["completion_ids"]) == 1 else 2)


def test_subprocess_agent_reports_its_reward_on_stdout(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent", "agent.mode=subprocess",
                          f"agent.command=[{sys.executable},{HERE / 'toy_agents.py'}]",
                          "total_train_steps=1", name="agent-subprocess")
    rows = _train_rows(train(cfg))
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["train/grad_norm"] > 0 and rows[0]["rollout/episodes_failed"] == 0
    assert rows[0]["agent/completions"] >= 2 * 2  # a batch: 2 items x 2 sessions, one call each


def test_inline_agent_that_sets_its_reward_through_the_proxy(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent",
                          "agent.fn=toy_agents:rewards_itself", "total_train_steps=1",
                          name="agent-set-reward")
    rows = _train_rows(train(cfg))
    assert rows[0]["train/grad_norm"] > 0 and rows[0]["rollout/episodes_failed"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", [pytest.param("inline", marks=pytest.mark.slow), "service"])
def test_online_training_learns_from_an_outside_client(tmp_path, tiny_model, where):
    """A separate process that knows only the base_url and the admin key drives sessions,
    with the proxy in the controller or in the agent service's own process (grants)."""
    port = _free_port()
    client = subprocess.Popen(
        [sys.executable, str(REPO / "examples/agents/online/client.py"),
         "--base-url", f"http://127.0.0.1:{port}", "--admin-key", "admin-key-e2e",
         "--sessions", "200", "--concurrency", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent", "agent.mode=online",
                              "agent.admin_key=admin-key-e2e", f"agent.port={port}",
                              "actor.reward_norm=null",
                              "rollout.max_head_offpolicyness=0", f"scheduler.agent={where}",
                              name=f"agent-online-{where}")
        summary = train(cfg)
        rows = _train_rows(summary)
    finally:
        out = client.communicate(timeout=60)[0]
    assert [r["step"] for r in rows] == [1, 2]
    # eta = 0, B = 2: each step trains on exactly the 2 sessions it admitted, the rest of
    # the client's attempts got 429 and waited.
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    assert rows[-1]["sessions/started"] >= 4 and rows[-1]["sessions/rejected_429"] > 0
    assert "Traceback" not in out, out
    agent = [s for s in summary["services"] if s["role"] == "agent"]
    assert agent == ([] if where == "inline" else
                     [{"role": "agent", "index": 0, "address": f"http://127.0.0.1:{port}",
                       "node_id": agent[0]["node_id"]}])


@pytest.mark.parametrize("router", [
    "inline", pytest.param("service", marks=pytest.mark.slow)])  # the router: services_e2e
def test_agent_service_process_runs_inline_agents(tmp_path, tiny_model, router):
    """scheduler.agent=service: the proxy is its own process; the controller opens and
    closes the sessions of its inline agent over HTTP and trains on what comes back. With
    a router service, the controller and the agent service both generate through it."""
    export = tmp_path / "sessions"
    cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent",
                          "agent.fn=toy_agents:two_turns", f"agent.export_dir={export}",
                          "scheduler.agent=service", f"scheduler.router={router}",
                          name=f"agent-service-{router}")
    summary = train(cfg)
    rows = _train_rows(summary)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/grad_norm"] > 0 and rows[-1]["rollout/episodes_failed"] == 0
    # The service counted the sessions (2 steps x 2 items x 2 samples at least) ...
    assert rows[-1]["sessions/ended"] >= 8 and rows[-1]["agent/completions"] >= 16
    [agent] = [s for s in summary["services"] if s["role"] == "agent"]
    assert summary["agent_base_url"] == agent["address"] + "/v1"
    # ... and its process wrote them: each ended session has both turns, token for token.
    sessions = [json.loads(x) for x in (export / "sessions.jsonl").read_text().splitlines()]
    ended = [s for s in sessions if s["status"] == "ended"]
    assert len(ended) >= 8 and all(len(s["completions"]) == 2 for s in ended)
    trained = set()
    for line in (Path(summary["run_dir"]) / "batches.jsonl").read_text().splitlines():
        trained |= set(json.loads(line)["group_ids"])
    assert len(trained) == 2 * 2  # 2 steps x 2 episodes, each one group


@pytest.mark.slow  # ~40 s
def test_a_killed_agent_service_is_restarted_and_no_lost_session_is_trained(tmp_path,
                                                                             tiny_model):
    """The agent service SIGKILLed once step 1 is logged, sessions in flight: the trainer
    restarts it, the lost sessions' episodes fail (reported) and run again, and every
    trained trajectory is a whole session that the service recorded as ended."""
    from procs import train_killing

    export = tmp_path / "sessions"
    cfg = tiny_run_config(tmp_path, tiny_model, "workflow.type=agent",
                          "agent.fn=toy_agents:two_turns_slowly", f"agent.export_dir={export}",
                          "scheduler.agent=service", "total_train_steps=4",
                          "rollout.episode_retries=2",
                          # step 1 is logged once the servers hold v1: the next sessions
                          # have just started when the kill comes (with the load overlapped
                          # they start only after it, and may not have yet)
                          "actor.weight_update_overlap=false", name="agent-kill")
    run = tmp_path / "runs" / "agent-kill" / cfg.trial_name
    summary = train_killing(cfg, run, "agent")
    rows = _train_rows(summary)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["agent/service_restarts"] == 1 and rows[-1]["rollout/episodes_failed"] == 0
    assert "the agent service failed" in (run / "logs" / "trainer.log").read_text()
    # the sessions in flight at the kill: their episodes failed and were run again
    failures = [json.loads(x) for x in (run / "failures.jsonl").read_text().splitlines()]
    assert failures and all(f["retried"] for f in failures)
    # what was trained: whole sessions, each recorded as ended (two turns) by a service
    ended = {s["session_id"]: s for s in map(json.loads, (export / "sessions.jsonl").read_text()
                                     .splitlines()) if s["status"] == "ended"}
    batches = [json.loads(x) for x in (run / "batches.jsonl").read_text().splitlines()]
    trained = [sid for b in batches for sid in b["session_ids"]]
    assert len(set(trained)) == 4 * 2 * 2  # 4 steps x 2 items x 2 samples, one trajectory each
    assert all(sid in ended and len(ended[sid]["completions"]) == 2 for sid in trained)
