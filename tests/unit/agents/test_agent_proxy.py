"""The agent proxy over a scripted engine: sessions, keys, capture, retries, capacity, timeouts."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from asyncrl.agents.capture import export
from asyncrl.agents.proxy import AgentProxy
from asyncrl.agents.session import SessionStatus
from asyncrl.api.types import GenerationRequest, GenerationResponse, StopReason
from asyncrl.models.tiny import make_tiny_tokenizer
from asyncrl.openai.tool_calls import hermes_messages
from scripted_engine import ScriptedEngine

ADMIN = "admin-key-123"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def start_proxy(tokenizer, replies, **kwargs):
    engine = ScriptedEngine(tokenizer, replies)
    proxy = AgentProxy(engine, tokenizer, "policy", admin_key=ADMIN, **kwargs)
    await proxy.start("127.0.0.1", 0)
    return proxy, engine


async def post(url: str, key: str | None, body, headers=None) -> tuple[int, dict, dict]:
    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers={**hdrs, **(headers or {})}) as r:
            return r.status, await r.json(), dict(r.headers)


def root(proxy) -> str:
    return proxy.base_url[: -len("/v1")]


def test_two_turn_tool_conversation_merges_into_one_exact_trajectory(tokenizer):
    async def main():
        proxy, engine = await start_proxy(tokenizer, [CALL, "17 * 23 = 391."])
        status, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {"task_id": "t1"})
        assert status == 200
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"])
        messages = [{"role": "user", "content": "What is 17 * 23?"}]
        first = await client.chat.completions.create(model="anything", messages=messages,
                                                     tools=TOOLS)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        call = msg.tool_calls[0]
        assert json.loads(call.function.arguments) == {"expression": "17 * 23"}
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "391"}]
        second = await client.chat.completions.create(model="anything", messages=messages,
                                                      tools=TOOLS)
        assert second.choices[0].message.content == "17 * 23 = 391."
        status, r, _ = await post(f"{root(proxy)}/rl/set_reward", s["api_key"], {"reward": 1.0})
        assert status == 200 and r["completion_id"] == f"{s['session_id']}-1"
        status, _, _ = await post(f"{root(proxy)}/rl/end_session", s["api_key"], {})
        assert status == 200
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return session, engine

    session, engine = run(main())
    assert session.status is SessionStatus.ENDED
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (1, 1, 0)
    [traj] = out.trajectories
    # Independent tokenisation: the whole conversation through the template, the model's
    # own text for its first turn, then the final answer's tokens and EOS.
    history = hermes_messages([{"role": "user", "content": "What is 17 * 23?"},
                               {"role": "assistant", "content": CALL},
                               {"role": "tool", "content": "391"}], TOOLS, "auto")
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token_id
    expected = tokenizer.encode(text, add_special_tokens=False) + \
        tokenizer.encode("17 * 23 = 391.") + [eos]
    assert traj.input_ids == expected
    # The loss covers exactly the two sampled outputs, with their log-probs.
    first, second = session.completions
    n1 = len(first.prompt_ids)
    call_ids = tokenizer.encode(CALL) + [eos]
    assert traj.input_ids[n1:n1 + len(call_ids)] == call_ids
    assert [i for i, m in enumerate(traj.loss_mask) if m] == \
        list(range(n1, n1 + len(call_ids))) + \
        list(range(len(second.prompt_ids), len(expected)))
    assert traj.behavior_logprobs[n1 + 3] == pytest.approx(-0.03)
    assert traj.reward == 1.0 and traj.meta["n_turns"] == 2
    assert len(engine.calls) == 2


def test_history_that_does_not_extend_falls_back_and_is_counted(tokenizer):
    async def main():
        proxy, _ = await start_proxy(tokenizer, ["first answer", "second answer"])
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"])
        messages = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="m", messages=messages)
        # The agent rewrites the assistant turn before sending it back.
        messages += [{"role": "assistant", "content": "an edited answer"},
                     {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=messages)
        await post(f"{root(proxy)}/rl/set_reward", s["api_key"], {"reward": 0.5})
        await post(f"{root(proxy)}/rl/end_session", s["api_key"], {})
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return session

    session = run(main())
    out = export(session.completions, style="tree", discount=0.5, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (2, 0, 1)
    # Rewards: r = [unset, 0.5]; G = [0 + 0.5 * 0.5, 0.5]; both pieces get G_0.
    assert [t.reward for t in out.trajectories] == [0.25, 0.25]
    assert [t.meta["drift"] for t in out.trajectories] == [False, True]


def test_a_retried_request_gets_the_first_answer_not_a_new_sample(tokenizer):
    async def main():
        proxy, engine = await start_proxy(tokenizer, ["one", "two"])
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{proxy.base_url}/chat/completions"
        first = await post(url, s["api_key"], body, {"x-stainless-retry-count": "0"})
        again = await post(url, s["api_key"], body, {"x-stainless-retry-count": "1"})
        fresh = await post(url, s["api_key"], body)  # no retry header: a new sample
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return first, again, fresh, engine, session, proxy

    first, again, fresh, engine, session, proxy = run(main())
    assert first[1]["choices"][0]["message"]["content"] == "one"
    assert again[1]["choices"][0]["token_ids"] == first[1]["choices"][0]["token_ids"]
    assert fresh[1]["choices"][0]["message"]["content"] == "two"
    assert len(engine.calls) == 2 and len(session.completions) == 2
    assert proxy.counts["retries_replayed"] == 1


def test_capacity_gives_429_with_retry_after_then_a_grant_once_a_session_ends(tokenizer):
    from asyncrl.agents.proxy import SessionLimit

    async def main():
        proxy, _ = await start_proxy(tokenizer, ["x"])
        proxy.admission = SessionLimit(proxy.store, 1)
        url = f"{root(proxy)}/rl/start_session"
        a = await post(url, ADMIN, {"task_id": "a"})
        b = await post(url, ADMIN, {"task_id": "b"})
        await post(f"{root(proxy)}/rl/end_session", a[1]["api_key"], {})
        c = await post(url, ADMIN, {"task_id": "c"})
        await proxy.stop()
        return a, b, c, proxy

    a, b, c, proxy = run(main())
    assert a[0] == 200 and c[0] == 200
    assert b[0] == 429 and b[2]["Retry-After"] == "1"
    assert proxy.counts["rejected_429"] == 1


def test_keys_rewards_and_bodies_are_checked(tokenizer):
    async def main():
        proxy, _ = await start_proxy(tokenizer, ["x"])
        r = root(proxy)
        out = {"no_admin": await post(f"{r}/rl/start_session", "wrong-key", {}),
               "bad_field": await post(f"{r}/rl/start_session", ADMIN, {"taskid": "x"})}
        _, s, _ = await post(f"{r}/rl/start_session", ADMIN, {"api_key": "fixed-key-0001"})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        out["wrong_key"] = await post(f"{proxy.base_url}/chat/completions", "nope", body)
        out["no_completion"] = await post(f"{r}/rl/set_reward", s["api_key"], {"reward": 1})
        await post(f"{proxy.base_url}/chat/completions", s["api_key"], body)
        out["bad_reward"] = await post(f"{r}/rl/set_reward", s["api_key"], {"reward": "1"})
        out["unknown_completion"] = await post(f"{r}/rl/set_reward", s["api_key"],
                                               {"reward": 1, "completion_id": "c9"})
        out["unknown_session"] = await post(f"{r}/rl/set_reward", ADMIN,
                                            {"reward": 1, "session_id": "sess-none"})
        # The same fixed key starts a new session: the old one ends and is exported.
        _, s2, _ = await post(f"{r}/rl/start_session", ADMIN, {"api_key": "fixed-key-0001"})
        out["old_ended"] = proxy.store.get(s["session_id"]).status
        await post(f"{r}/rl/end_session", s2["api_key"], {})
        out["late_reward"] = await post(f"{r}/rl/set_reward", s2["api_key"], {"reward": 1})
        out["late_chat"] = await post(f"{proxy.base_url}/chat/completions", s2["api_key"], body)
        await proxy.stop()
        return out

    out = run(main())
    assert out["no_admin"][0] == 401
    assert out["bad_field"][0] == 400 and out["bad_field"][1]["error"]["param"] == "taskid"
    assert out["wrong_key"][0] == 401
    assert out["no_completion"][0] == 409
    assert out["bad_reward"][0] == 400 and out["bad_reward"][1]["error"]["param"] == "reward"
    assert out["unknown_completion"][0] == 404
    assert out["unknown_session"][0] == 404
    assert out["old_ended"] is SessionStatus.ENDED
    assert out["late_reward"][0] == 409 and "ended" in out["late_reward"][1]["error"]["message"]
    assert out["late_chat"][0] == 409


def test_sessions_of_a_proxy_that_restarted_are_reported_lost_not_unknown(tokenizer):
    async def main():
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        first, _ = await start_proxy(tokenizer, ["x"])
        _, s, _ = await post(f"{root(first)}/rl/start_session", ADMIN, {})
        assert (await post(f"{first.base_url}/chat/completions", s["api_key"], body))[0] == 200
        await first.stop()  # the process ends: its sessions with it
        second, _ = await start_proxy(tokenizer, ["y"])
        r = root(second)
        out = {"chat": await post(f"{second.base_url}/chat/completions", s["api_key"], body),
               "reward": await post(f"{r}/rl/set_reward", s["api_key"], {"reward": 1}),
               "close": await post(f"{r}/rl/close_session", ADMIN,
                                   {"session_id": s["session_id"]}),
               "made_up": await post(f"{second.base_url}/chat/completions",
                                     "sk-asyncrl-zz-not-ours", body),
               "sessions": second.store.counts["started"]}
        await second.stop()
        return out

    out = run(main())
    for name in ("chat", "reward", "close"):
        status, answer, _ = out[name]
        assert status == 410, name
        assert "restarted" in answer["error"]["message"]
        assert "none of it is trained" in answer["error"]["message"]
    assert out["chat"][1]["error"]["code"] == "session_lost"
    assert out["made_up"][0] == 401  # not a key any proxy issued: still just wrong
    assert out["sessions"] == 0  # nothing was recorded for the lost session


def test_an_idle_session_times_out_and_is_reported(tokenizer):
    ended = []

    async def main():
        proxy, _ = await start_proxy(tokenizer, ["x"], session_timeout=0.2, on_end=ended.append)
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        await asyncio.sleep(0.6)
        late = await post(f"{root(proxy)}/rl/set_reward", s["api_key"], {"reward": 1})
        stats = proxy.stats()
        await proxy.stop()
        return s, late, stats

    s, late, stats = run(main())
    assert [x.id for x in ended] == [s["session_id"]]
    assert ended[0].status is SessionStatus.TIMED_OUT
    assert stats["sessions/timed_out"] == 1.0
    assert late[0] == 409 and "timed_out" in late[1]["error"]["message"]


def test_a_session_too_far_behind_the_weights_ends_with_version_lag(tokenizer):
    async def main():
        version = {"v": 0}
        proxy, _ = await start_proxy(tokenizer, ["x"], version=lambda: version["v"],
                                     max_session_version_lag=1)
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{proxy.base_url}/chat/completions"
        version["v"] = 1
        ok = await post(url, s["api_key"], body)
        version["v"] = 2
        lagged = await post(url, s["api_key"], body)
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return ok, lagged, session

    ok, lagged, session = run(main())
    assert ok[0] == 200
    assert lagged[0] == 409 and "version_lag" in lagged[1]["error"]["message"]
    assert session.status is SessionStatus.VERSION_LAG and len(session.completions) == 1


def test_sessions_force_the_trainers_sampling(tokenizer):
    async def main():
        proxy, engine = await start_proxy(tokenizer, ["x"], sampling={
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8,
            "stop_token_ids": [2]})
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        await post(f"{proxy.base_url}/chat/completions", s["api_key"], {
            "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.2, "max_tokens": 100})
        await proxy.stop()
        return engine.calls[0].sampling

    sampling = run(main())
    assert (sampling.temperature, sampling.max_new_tokens) == (1.0, 8)
    assert 2 in sampling.stop_token_ids


def test_a_sessions_requests_carry_its_id_as_their_affinity_key(tokenizer):
    async def main():
        proxy, engine = await start_proxy(tokenizer, ["a", "b", "c"])
        ids = []
        for _ in range(2):
            _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
            ids.append(s["session_id"])
            messages = [{"role": "user", "content": "hi"}]
            await post(f"{proxy.base_url}/chat/completions", s["api_key"],
                       {"model": "m", "messages": messages})
        await proxy.stop()
        return ids, [c.affinity for c in engine.calls]

    ids, affinities = run(main())
    assert affinities == ids and ids[0] != ids[1]


def test_streamed_responses_and_anthropic_requests_are_recorded_too(tokenizer):
    import anthropic

    async def main():
        proxy, engine = await start_proxy(tokenizer, ["streamed", "via responses",
                                                      "via messages"])
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"])
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        resp = await client.responses.create(model="m", input="hello")
        claude = anthropic.AsyncAnthropic(base_url=root(proxy), api_key=s["api_key"])
        msg = await claude.messages.create(model="claude-x", max_tokens=16,
                                           messages=[{"role": "user", "content": "hey"}])
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return text, resp, msg, session

    text, resp, msg, session = run(main())
    assert text == "streamed"
    assert resp.output_text == "via responses"
    assert msg.content[0].text == "via messages"
    assert [c.route for c in session.completions] == ["chat", "responses", "messages"]
    assert [c.text for c in session.completions] == ["streamed", "via responses", "via messages"]
    # The Anthropic request's prompt is the same chat template over its messages.
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hey"}],
                                             tokenize=False, add_generation_prompt=True)
    assert session.completions[2].prompt_ids == tokenizer.encode(expected,
                                                                 add_special_tokens=False)


def test_count_tokens_is_the_next_turns_prompt_length_and_records_nothing(tokenizer):
    import anthropic

    async def main():
        proxy, engine = await start_proxy(tokenizer, ["first reply", "second"])
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        claude = anthropic.AsyncAnthropic(base_url=root(proxy), api_key=s["api_key"])
        first = await claude.messages.create(model="claude-x", max_tokens=16,
                                             messages=[{"role": "user", "content": "hey"}])
        history = [{"role": "user", "content": "hey"},
                   {"role": "assistant", "content": first.content[0].text},
                   {"role": "user", "content": "more"}]
        counted = await claude.messages.count_tokens(model="claude-x", messages=history)
        recorded_before = len(proxy.store.get(s["session_id"]).completions)
        await claude.messages.create(model="claude-x", max_tokens=16, messages=history)
        unkeyed, _, _ = await post(f"{root(proxy)}/v1/messages/count_tokens", None,
                                   {"model": "m", "messages": history})
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return counted, recorded_before, session, unkeyed

    counted, recorded_before, session, unkeyed = run(main())
    assert recorded_before == 1 and len(session.completions) == 2 and unkeyed == 401
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hey"},
         {"role": "assistant", "content": session.completions[0].text},
         {"role": "user", "content": "more"}], tokenize=False, add_generation_prompt=True)
    assert session.completions[0].text == "first reply"
    assert counted.input_tokens == len(session.completions[1].prompt_ids) == len(
        tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("where", ["inline", "service"])
def test_an_episode_whose_session_the_proxy_ended_is_dropped_not_failed(tokenizer, where):
    """The same episodes with the proxy in this process and behind the agent service's
    HTTP client (agents/service.py): a version-lagged session drops its episode."""
    from asyncrl.agents.proxy import LocalSessions
    from asyncrl.agents.service import AgentClient, AgentService
    from asyncrl.controller.workflows.agent import AgentSpec, AgentWorkflow

    version = {"v": 0}
    client = None

    async def set_version(v):
        version["v"] = v
        if client is not None:
            await client.set_version(v)

    async def agent(base_url, api_key, item):
        llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        await set_version(5)  # the trainer moved on while the agent was thinking
        await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        return 1.0

    async def ok_agent(base_url, api_key, item):
        llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        return 0.5

    async def main():
        nonlocal client
        engine = ScriptedEngine(tokenizer, ["x"])
        proxy = AgentProxy(engine, tokenizer, "policy", admin_key=ADMIN,
                           version=lambda: version["v"], max_session_version_lag=2)
        if where == "service":
            AgentService(proxy, engine)
        await proxy.start("127.0.0.1", 0)
        if where == "service":
            client = AgentClient(root(proxy), ADMIN)
            sessions = client
        else:
            sessions = LocalSessions(proxy)
        dropped = await AgentWorkflow(sessions, agent, AgentSpec(n_samples=2)).run(None, {"id": "i"})
        await set_version(0)
        kept = await AgentWorkflow(sessions, ok_agent, AgentSpec(n_samples=2)).run(None, {"id": "j"})
        stats = proxy.stats()
        if client is not None:
            assert await client.stats() == stats
            await client.close_client()
        await proxy.stop()
        return dropped, kept, stats

    dropped, kept, stats = run(main())
    assert dropped is None and stats["sessions/version_lag"] >= 1
    assert [t.reward for t in kept] == [0.5, 0.5] and kept[0].group_id == kept[1].group_id
    # The trajectories are the engine's tokens: prompt masked, output ids and log-probs exact.
    out_ids = tokenizer.encode("x") + [tokenizer.eos_token_id]
    for t in kept:
        n = len(out_ids)
        assert t.input_ids[-n:] == out_ids and t.loss_mask[-n:] == [1] * n
        assert sum(t.loss_mask) == n
        assert t.behavior_logprobs[-n:] == pytest.approx([-0.01 * j for j in range(n)])


class StuckEngine(ScriptedEngine):
    async def agenerate(self, req: GenerationRequest) -> GenerationResponse:
        await asyncio.sleep(120)  # a generation that will not end before the run does
        raise AssertionError("unreachable")


def test_stopping_the_proxy_does_not_wait_for_generations_in_flight(tokenizer):
    """A run's exit stops its proxy while agents still wait on generations: the requests in
    flight get SHUTDOWN_GRACE_S, not aiohttp's 60 s (CI once timed out there)."""
    from asyncrl.api.http import SHUTDOWN_GRACE_S

    async def main():
        proxy = AgentProxy(StuckEngine(tokenizer, ["x"]), tokenizer, "policy", admin_key=ADMIN)
        await proxy.start("127.0.0.1", 0)
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {"task_id": "t"})
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"],
                                    max_retries=0, timeout=60)
        call = asyncio.create_task(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]))
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await proxy.stop()
        took = loop.time() - t0
        with pytest.raises(openai.APIError):
            await call
        return took, proxy.store.by_id[s["session_id"]].status

    took, status = run(main())
    # aiohttp waits twice (closing the site, then the server): 2 x 3 s here, not 2 x 60
    assert took < 2 * SHUTDOWN_GRACE_S + 3
    assert status is SessionStatus.CANCELLED


def test_a_simulated_users_calls_are_answered_with_its_own_sampling_and_never_captured(
        tokenizer):
    """Agent, user, agent: the engine answers all three, the session keeps only the two
    agent turns, and the one trajectory's loss covers exactly the agent's sampled tokens."""
    from asyncrl.agents.user import ModelUser

    async def main():
        proxy, engine = await start_proxy(tokenizer, ["agent one", "user says hi", "agent two"],
                                          sampling={"temperature": 1.0, "max_new_tokens": 8})
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"])
        user = ModelUser(proxy.base_url, s["api_key"], system="You are a customer.",
                         opening="hello", temperature=0.0, max_tokens=20)
        messages = [{"role": "user", "content": "hello"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        said = first.choices[0].message.content
        reply = await user.reply(said)
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": reply}]
        await client.chat.completions.create(model="m", messages=messages)
        await user.close()
        stats = proxy.stats()
        await post(f"{root(proxy)}/rl/end_session", s["api_key"], {})
        # An ended session's key no longer reaches the untrained route either.
        late = await post(f"{root(proxy)}/untrained/v1/chat/completions", s["api_key"],
                          {"model": "u", "messages": [{"role": "user", "content": "x"}]})
        wrong = await post(f"{root(proxy)}/untrained/v1/chat/completions", "sk-nobody-123",
                           {"model": "u", "messages": [{"role": "user", "content": "x"}]})
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return session, engine, reply, stats, late[0], wrong[0]

    session, engine, reply, stats, late, wrong = run(main())
    assert reply == "user says hi"
    assert (late, wrong) == (409, 401)
    assert len(engine.calls) == 3 and stats["sessions/untrained_completions"] == 1.0
    # The user's call kept its own temperature and token cap; the agent's were forced.
    samplings = [(c.sampling.temperature, c.sampling.max_new_tokens) for c in engine.calls]
    assert samplings == [(1.0, 8), (0.0, 20), (1.0, 8)]
    assert [c.text for c in session.completions] == ["agent one", "agent two"]
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    assert (len(out.trajectories), out.merged) == (1, 1)
    [traj] = out.trajectories
    trained = [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]
    eos = tokenizer.eos_token_id
    assert trained == tokenizer.encode("agent one") + [eos] + tokenizer.encode("agent two") + [eos]
    # The user's words sit in the prompt of the second turn, masked out, never as output.
    user_ids = tokenizer.encode("user says hi")
    n = len(user_ids)
    starts = [i for i in range(len(traj.input_ids) - n + 1)
              if traj.input_ids[i:i + n] == user_ids]
    assert starts and all(not any(traj.loss_mask[i:i + n]) for i in starts)


def test_a_session_whose_only_request_was_too_long_fails_saying_so(tokenizer):
    """A runtime that exits 0 after its first request was refused (Claude Code prints the
    error and returns a result): the session fails and its reason quotes the refusal."""
    import anthropic

    async def main():
        proxy, engine = await start_proxy(tokenizer, ["never"], max_model_len=64)
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {"task_id": "t"})
        claude = anthropic.AsyncAnthropic(base_url=root(proxy), api_key=s["api_key"],
                                          max_retries=0)
        with pytest.raises(anthropic.BadRequestError):
            await claude.messages.create(model="claude-x", max_tokens=16,
                                         messages=[{"role": "user", "content": "x" * 100}])
        session = proxy.store.get(s["session_id"])
        outcome = proxy.close_session(session, reward=1.0)
        summary = session.summary()
        await proxy.stop()
        return outcome, session, summary, engine

    outcome, session, summary, engine = run(main())
    # ChatML over a byte tokenizer: <|im_start|> "user\n" + 100 bytes <|im_end|> "\n" and the
    # generation prompt <|im_start|> "assistant\n" = 1 + 5 + 100 + 1 + 1 + 1 + 10 tokens.
    refusal = ("POST /v1/messages 400: prompt is too long: 119 tokens > 63 maximum")
    assert outcome == "no_completion" and engine.calls == []
    assert session.status is SessionStatus.FAILED
    assert session.reason.startswith(f"no model call; its last refused request: {refusal}")
    assert summary["refused"][0].startswith(refusal)


@pytest.mark.parametrize("retry_header", ["0", "1"])
def test_an_answer_the_client_gave_up_on_is_not_recorded_its_retry_is(tokenizer, retry_header):
    """A client that times out and sends the same request again (Claude Code does, with
    retry count 0; SDKs with 1): the session holds exactly the sample the client got."""
    class Slow(ScriptedEngine):
        async def agenerate(self, req):
            if not self.calls:
                await asyncio.sleep(0.5)  # past the client's first timeout
            return await super().agenerate(req)

    async def main():
        engine = Slow(tokenizer, ["lost", "kept"])
        proxy = AgentProxy(engine, tokenizer, "policy", admin_key=ADMIN)
        await proxy.start("127.0.0.1", 0)
        _, s, _ = await post(f"{root(proxy)}/rl/start_session", ADMIN, {})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{proxy.base_url}/chat/completions"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(post(url, s["api_key"], body), 0.1)
        await asyncio.sleep(0.6)  # the first answer is ready and finds its client gone
        _, got, _ = await post(url, s["api_key"], body, {"x-stainless-retry-count": retry_header})
        session = proxy.store.get(s["session_id"])
        await proxy.stop()
        return got, session, proxy, engine

    got, session, proxy, engine = run(main())
    replayed = retry_header == "1"  # the first sample again, else a new one
    assert got["choices"][0]["message"]["content"] == ("lost" if replayed else "kept")
    assert [c.text for c in session.completions] == [got["choices"][0]["message"]["content"]]
    assert session.completions[0].output_ids == got["choices"][0]["token_ids"]
    assert len(engine.calls) == (1 if replayed else 2)
    assert proxy.counts["lost_answers"] == 1
