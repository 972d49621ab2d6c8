"""The agent service's controller routes over a scripted engine: grants, close, version."""

from __future__ import annotations

import asyncio

import openai
import pytest
from test_agent_proxy import ADMIN, ScriptedEngine, post, root, run

from asyncrl.agents.proxy import AgentProxy
from asyncrl.agents.service import AgentClient, AgentService, AgentServiceError
from asyncrl.models.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


class Servers(ScriptedEngine):
    """A scripted engine that also has server addresses (for /rl/servers)."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.addresses = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        self.checked = 0

    def replace_server(self, index, address):
        self.addresses[index] = address

    async def check_servers(self):
        self.checked += 1


async def start_service(tokenizer, replies, **kwargs):
    engine = Servers(tokenizer, replies)
    proxy = AgentProxy(engine, tokenizer, "policy", admin_key=ADMIN, **kwargs)
    service = AgentService(proxy, engine)
    await proxy.start("127.0.0.1", 0)
    return proxy, service, engine


def test_an_online_session_needs_a_grant_and_comes_back_whole(tokenizer):
    async def main():
        proxy, service, _ = await start_service(tokenizer, ["first", "second"])
        url = root(proxy)
        status, body, headers = await post(f"{url}/rl/start_session", ADMIN, {"task_id": "t"})
        assert status == 429 and headers["Retry-After"] == "1"  # no grant held

        client = AgentClient(url, ADMIN)
        service.version = 7
        grant = asyncio.create_task(client.await_session(3, timeout=10))
        await asyncio.sleep(0.1)
        status, s, _ = await post(f"{url}/rl/start_session", ADMIN, {"task_id": "t"})
        assert status == 200 and s["start_version"] == 3  # the grant's version, not 7
        llm = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"], max_retries=0)
        for text in ("a", "b"):
            await llm.chat.completions.create(model="m",
                                              messages=[{"role": "user", "content": text}])
        assert not grant.done()  # it answers when the session ends
        await post(f"{url}/rl/set_reward", s["api_key"], {"reward": 0.25})
        await post(f"{url}/rl/end_session", s["api_key"], {})
        session = await asyncio.wait_for(grant, 5)
        # A second client finds no grant again: one grant, one session.
        status, _, _ = await post(f"{url}/rl/start_session", ADMIN, {"task_id": "t"})
        await client.close_client()
        await proxy.stop()
        return session, status

    session, status = run(main())
    assert status == 429
    assert session.status.value == "ended" and session.start_version == 3
    assert [c.text for c in session.completions] == ["first", "second"]
    assert [c.reward for c in session.completions] == [None, 0.25]
    out = tokenizer.encode("first") + [tokenizer.eos_token_id]
    assert session.completions[0].output_ids == out
    assert session.completions[0].logprobs == pytest.approx([-0.01 * j for j in range(len(out))])


def test_a_grant_no_client_takes_lapses(tokenizer):
    async def main():
        proxy, _, _ = await start_service(tokenizer, ["x"])
        client = AgentClient(root(proxy), ADMIN)
        t0 = asyncio.get_running_loop().time()
        lapsed = await client.await_session(0, timeout=0.3)
        waited = asyncio.get_running_loop().time() - t0
        status, _, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        await client.close_client()
        await proxy.stop()
        return lapsed, waited, status

    lapsed, waited, status = run(main())
    assert lapsed is None and 0.25 < waited < 3
    assert status == 429  # the lapsed grant admits nobody


def test_close_session_outcomes(tokenizer):
    """ended with the agent's reward; a reward without a model call; a failure; a session
    the proxy had already ended keeps its status."""
    async def main():
        proxy, service, _ = await start_service(tokenizer, ["x"], max_session_version_lag=1)
        client = AgentClient(root(proxy), ADMIN)
        out = {}

        async def session_with_call(start_version=None):
            sid, key = await client.open(task_id="t", sampling={}, start_version=start_version)
            llm = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
            await llm.chat.completions.create(model="m",
                                              messages=[{"role": "user", "content": "q"}])
            return sid, llm

        sid, _ = await session_with_call()
        out["ended"] = await client.close(sid, reward=1.5)
        sid, _ = await client.open(task_id="t", sampling={})
        out["no_call"] = await client.close(sid, reward=1.0)
        sid, _ = await session_with_call()
        out["failed"] = await client.close(sid, failure="ValueError: boom")
        sid, llm = await session_with_call(start_version=0)
        await client.set_version(2)  # two versions on: the next request ends it
        with pytest.raises(openai.ConflictError):
            await llm.chat.completions.create(model="m",
                                              messages=[{"role": "user", "content": "q"}])
        out["lagged"] = await client.close(sid, reward=1.0)
        await client.close_client()
        await proxy.stop()
        return out

    out = run(main())
    outcome, s = out["ended"]
    assert outcome == "ended" and s.status.value == "ended" and s.completions[-1].reward == 1.5
    outcome, s = out["no_call"]
    assert outcome == "no_completion" and s.status.value == "failed" and s.reason == "no model call"
    outcome, s = out["failed"]
    assert outcome == "failed" and s.reason == "ValueError: boom"
    outcome, s = out["lagged"]
    assert outcome == "already_ended" and s.status.value == "version_lag"
    assert [c.reward for c in s.completions] == [None]  # no reward given to a dropped session


def test_controller_routes_need_the_admin_key_and_name_bad_fields(tokenizer):
    async def main():
        proxy, service, engine = await start_service(tokenizer, ["x"])
        url = root(proxy)
        res = {
            "no_key": await post(f"{url}/rl/version", None, {"version": 1}),
            "wrong_key": await post(f"{url}/rl/await_session", "nope", {"version": 1}),
            "close_no_key": await post(f"{url}/rl/close_session", None, {"session_id": "s"}),
            "bad_version": await post(f"{url}/rl/version", ADMIN, {"version": -1}),
            "bad_field": await post(f"{url}/rl/version", ADMIN, {"v": 1}),
            "bad_index": await post(f"{url}/rl/servers", ADMIN, {"index": 2, "address": "x"}),
            "bad_timeout": await post(f"{url}/rl/await_session", ADMIN,
                                      {"version": 0, "timeout": 0}),
            "version_not_admitted": await post(f"{url}/rl/start_session", ADMIN,
                                               {"start_version": 1}),
            "unknown_session": await post(f"{url}/rl/close_session", ADMIN,
                                          {"session_id": "sess-none"}),
            "version": await post(f"{url}/rl/version", ADMIN, {"version": 4}),
            "server": await post(f"{url}/rl/servers", ADMIN,
                                 {"index": 1, "address": "http://127.0.0.1:9"}),
        }
        client = AgentClient(url, "wrong")
        with pytest.raises(AgentServiceError, match="401"):
            await client.set_version(1)
        await client.close_client()
        await proxy.stop()
        return res, service.version, engine

    res, version, engine = run(main())
    assert [res[k][0] for k in ("no_key", "wrong_key", "close_no_key")] == [401] * 3
    assert res["bad_version"][0] == 400 and res["bad_version"][1]["error"]["param"] == "version"
    assert res["bad_field"][0] == 400 and "'v'" in res["bad_field"][1]["error"]["message"]
    assert res["bad_index"][0] == 400 and res["bad_index"][1]["error"]["param"] == "index"
    assert res["bad_timeout"][0] == 400 and res["bad_timeout"][1]["error"]["param"] == "timeout"
    assert res["version_not_admitted"][0] == 400
    assert res["unknown_session"][0] == 404
    assert res["version"][0] == 200 and version == 4
    assert res["server"][0] == 200 and engine.addresses[1] == "http://127.0.0.1:9"
    assert engine.checked == 1


def test_session_calls_wait_for_a_service_that_comes_back_and_others_do_not(tokenizer):
    """AgentClient.open waits (up to wait_timeout) while the service cannot be connected to:
    the trainer is restarting it. Calls that are not a session's fail at once."""
    import socket

    with socket.socket() as s:  # a port nothing listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        url = f"http://127.0.0.1:{port}"
        gone = AgentClient(url, ADMIN, wait_timeout=0.6)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AgentServiceError, match="Cannot connect"):
            await gone.open(task_id="t", sampling={})
        waited = loop.time() - t0
        with pytest.raises(AgentServiceError, match="Cannot connect"):
            await gone.set_version(3)
        at_once = loop.time() - t0 - waited
        await gone.close_client()

        client = AgentClient(url, ADMIN, wait_timeout=20)
        opening = asyncio.create_task(client.open(task_id="t", sampling={}))
        await asyncio.sleep(0.8)  # the service comes back on its port
        engine = Servers(tokenizer, ["x"])
        proxy = AgentProxy(engine, tokenizer, "policy", admin_key=ADMIN)
        AgentService(proxy, engine)
        await proxy.start("127.0.0.1", port)
        sid, key = await asyncio.wait_for(opening, 10)
        await client.close_client()
        await proxy.stop()
        return waited, at_once, sid, key

    waited, at_once, sid, key = run(main())
    assert 0.5 <= waited < 3 and at_once < 0.4
    assert sid and key
