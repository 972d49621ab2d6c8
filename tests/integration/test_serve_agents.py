"""`asyncrl serve --admin-key K --export-dir D`: the agent proxy with its own engine, no trainer."""

import json
import os
import signal
import subprocess
import sys

import openai
import pytest
import requests
from procs import read_address

from asyncrl.models.tiny import make_tiny_model

pytestmark = pytest.mark.integration
ADMIN = "admin-key-serve"


def test_served_sessions_are_exported_as_jsonl_trajectories(tmp_path):
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    export = tmp_path / "export"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "serve", "--model", model, "--port", "0",
         "--dtype", "float32", "--max-seq-len", "256", "--device", "cpu", "--threads", "1",
         "--admin-key", ADMIN, "--export-dir", str(export), "--session-timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = read_address(proc, timeout=120).removesuffix("/v1")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert requests.post(f"{url}/rl/start_session", json={}, timeout=10).status_code == 401
        s = requests.post(f"{url}/rl/start_session", json={"task_id": "t"}, headers=admin,
                          timeout=10).json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=s["api_key"])
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="any", messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        second = client.chat.completions.create(model="any", messages=messages, max_tokens=6)
        key = {"Authorization": f"Bearer {s['api_key']}"}
        assert requests.post(f"{url}/rl/set_reward", json={"reward": 0.75}, headers=key,
                             timeout=10).status_code == 200
        assert requests.post(f"{url}/rl/end_session", json={}, headers=key,
                             timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    [session] = [json.loads(x) for x in (export / "sessions.jsonl").read_text().splitlines()]
    assert session["status"] == "ended" and session["rewards"] == [None, 0.75]
    c1, c2 = session["completions"]
    assert c2["output_ids"] == second.choices[0].model_dump()["token_ids"]
    rows = [json.loads(x) for x in (export / "trajectories.jsonl").read_text().splitlines()]
    merged = c2["prompt_ids"][:len(c1["prompt_ids"]) + len(c1["output_ids"])] == \
        c1["prompt_ids"] + c1["output_ids"]
    assert len(rows) == (1 if merged else 2)
    last = rows[-1]
    assert last["input_ids"] == c2["prompt_ids"] + c2["output_ids"]
    assert last["reward"] == 0.75 and last["messages"][-1]["role"] == "assistant"
    assert [last["logprobs"][i] for i in range(len(last["loss_mask"])) if last["loss_mask"][i]] \
        == (c1["logprobs"] if merged else []) + c2["logprobs"]
