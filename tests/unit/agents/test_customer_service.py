"""The customer-service domain: tools on the database, the policy, tau2's reward, the turn
loop with a scripted customer, task rows and splits; and the example agent end to end
through the proxy, with the customer played by the served model and never captured."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from asyncrl.agents.capture import export
from asyncrl.agents.customer_service import (
    THANKS,
    TaskError,
    call,
    converse,
    customer_service_items,
    expert,
    facts_given,
    make_toolbox,
    parse_task,
    score,
    scripted_reply,
)
from asyncrl.agents.runner import resolve_agent
from asyncrl.agents.user import STOP, ScriptedUser, untrained_base_url

ORDERS = {
    "W1111": {"status": "pending", "item": "lamp", "total": 37, "address": "5 Elm Road"},
    "W2222": {"status": "shipped", "item": "kettle", "total": 12, "address": "8 Oak Street"},
    "W3333": {"status": "delivered", "item": "teapot", "total": 90, "address": "1 Mill Lane"},
}


def item(kind: str, order_id: str, goal_change: dict, facts: list[str], *,
         new_address: str | None = None, question: str = "Hi, about my order.") -> dict:
    goal = copy.deepcopy(ORDERS)
    goal[order_id].update(goal_change)
    return {"id": f"t-{kind}-{order_id}", "question": question, "task": "customer_service",
            "metadata": {"kind": kind, "order_id": order_id, "db": {"orders": ORDERS},
                         "goal_db": {"orders": goal}, "facts": facts,
                         "new_address": new_address, "user": "scripted"}}


CANCEL_OK = item("cancel", "W1111", {"status": "cancelled"}, ["$37"])
CANCEL_REFUSED = item("cancel", "W2222", {}, ["shipped"])
ADDRESS_OK = item("address", "W1111", {"address": "60 Bridge Street"}, ["60 Bridge Street"],
                  new_address="60 Bridge Street")
REFUND_OK = item("refund", "W3333", {"status": "refunded"}, ["$90"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def play(it: dict, policy=None, **limits):
    task = parse_task(it)
    user = ScriptedUser(task.opening, scripted_reply(task))
    ep = run(converse(policy or expert(task), user, task, **limits))
    return task, ep


# -- reward ----------------------------------------------------------------------------


def test_reward_is_one_only_for_the_goal_database_and_every_fact_told():
    task = parse_task(CANCEL_OK)
    goal = task.goal_db
    wrong = copy.deepcopy(goal)
    wrong["orders"]["W2222"]["status"] = "cancelled"  # also cancelled a shipped order
    told = ["Order W1111 is cancelled. $37 will be refunded."]
    assert score(goal, told, task) == 1.0
    assert score(wrong, told, task) == 0.0
    assert score(goal, ["Order W1111 is cancelled."], task) == 0.0  # the refund unsaid
    assert score(task.db, told, task) == 0.0  # said it, did not do it


def test_facts_match_whole_words_ignoring_case_and_punctuation():
    assert facts_given(["Your refund is $37."], ["$37"])
    assert not facts_given(["Your refund is $370."], ["$37"])
    assert facts_given(["It is SHIPPED!"], ["shipped"])
    assert not facts_given(["It is unshipped"], ["shipped"])
    assert facts_given(["now 60 bridge street."], ["60 Bridge Street"])
    assert facts_given([], [])


# -- tools and policy ------------------------------------------------------------------


def test_tools_change_the_database_and_report_what_they_did():
    db = {"orders": copy.deepcopy(ORDERS)}
    box = make_toolbox(db)
    assert run(box.call("get_order", {"order_id": "w1111"})) == \
        "Order W1111: status pending, item lamp, total $37, address 5 Elm Road."
    assert run(box.call("cancel_order", {"order_id": "W1111"})) == \
        "Order W1111 is cancelled. $37 will be refunded."
    assert run(box.call("cancel_order", {"order_id": "W1111"})) == \
        "error: order W1111 is already cancelled"
    assert run(box.call("change_address", {"order_id": "W2222", "address": " 3 Hill Street "})) \
        == "The address of order W2222 is now 3 Hill Street."
    assert run(box.call("refund_order", {"order_id": "W3333"})) == \
        "Order W3333 is refunded. $90 will be paid back."
    assert [o["status"] for o in db["orders"].values()] == ["cancelled", "shipped", "refunded"]
    assert db["orders"]["W2222"]["address"] == "3 Hill Street"
    assert ORDERS["W1111"]["status"] == "pending"  # the task's own copy is untouched


def test_mistaken_calls_come_back_to_the_model_and_change_nothing():
    db = {"orders": copy.deepcopy(ORDERS)}
    box = make_toolbox(db)
    assert run(box.call("get_order", {"order_id": "W9999"})) == "error: there is no order W9999"
    assert run(box.call("delete_order", {"order_id": "W1111"})).startswith(
        "error: unknown tool 'delete_order'; available: get_order, cancel_order")
    assert run(box.call("cancel_order", {})) == \
        "error: cancel_order is missing argument(s): order_id"
    assert run(box.call("cancel_order", {"order_id": 1111})) == \
        "error: argument 'order_id' of cancel_order must be a string"
    assert run(box.call("change_address", '{"order_id": "W1111"')).startswith(
        "error: arguments are not valid JSON")
    assert run(box.call("change_address", {"order_id": "W1111", "address": " "})) == \
        "error: the address is empty"
    assert db == {"orders": ORDERS}


def test_an_unknown_tool_call_in_a_conversation_is_a_tool_message_for_the_model():
    async def policy(messages, tools):
        if len(messages) == 2:
            return {"content": "", "tool_calls": [call(0, "drop_table", order_id="W1111")]}
        return {"content": "Sorry."}
    task, ep = play(CANCEL_OK, policy)
    assert ep.messages[3] == {"role": "tool", "tool_call_id": "call_0", "content":
                              "error: unknown tool 'drop_table'; available: get_order, "
                              "cancel_order, change_address, refund_order"}
    assert score(ep.db, ep.said_to_user, task) == 0.0


def test_the_expert_refuses_what_the_policy_forbids_and_scores_one():
    task, ep = play(CANCEL_REFUSED)
    assert ep.said_to_user == ["Order W2222 is shipped, so it cannot be cancelled."]
    assert ep.db == task.goal_db == {"orders": ORDERS}
    assert score(ep.db, ep.said_to_user, task) == 1.0


def test_breaking_the_policy_changes_the_database_and_scores_zero():
    async def obliging(messages, tools):  # cancels a shipped order, as asked
        if messages[-1]["role"] == "user":
            return {"content": "Done.", "tool_calls": [call(0, "cancel_order", order_id="W2222")]}
        return {"content": "Order W2222 is cancelled; it was shipped. $12 will be refunded."}
    task, ep = play(CANCEL_REFUSED, obliging)
    assert ep.db["orders"]["W2222"]["status"] == "cancelled"
    assert facts_given(ep.said_to_user, task.facts)  # it even said "shipped"
    assert score(ep.db, ep.said_to_user, task) == 0.0


# -- the conversation ------------------------------------------------------------------


@pytest.mark.parametrize("it, calls, user_turns, final", [
    (CANCEL_OK, 3, 1, "Order W1111 is cancelled. $37 will be refunded."),
    (REFUND_OK, 3, 1, "Order W3333 is refunded. $90 will be paid back."),
    (ADDRESS_OK, 4, 2, "The address of order W1111 is now 60 Bridge Street."),
    (CANCEL_REFUSED, 2, 1, "Order W2222 is shipped, so it cannot be cancelled."),
], ids=["cancel", "refund", "address", "refused"])
def test_worked_episodes_alternate_agent_and_customer_until_it_stops(it, calls, user_turns,
                                                                    final):
    task, ep = play(it)
    assert (ep.model_calls, ep.user_turns, ep.ended_by) == (calls, user_turns, "user")
    assert ep.said_to_user[-1] == final
    assert score(ep.db, ep.said_to_user, task) == 1.0


def test_the_address_is_asked_for_and_the_customers_answer_is_in_the_history():
    task, ep = play(ADDRESS_OK)
    roles = [m["role"] for m in ep.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant",
                     "tool", "assistant"]
    assert ep.messages[5] == {"role": "user", "content": "The new address is 60 Bridge Street."}


def test_a_customer_that_never_stops_meets_the_turn_limit():
    async def chatty(messages, tools):
        return {"content": "How else can I help?"}
    task = parse_task(CANCEL_OK)
    user = ScriptedUser(task.opening, lambda said: "Tell me more.")
    ep = run(converse(chatty, user, task, max_model_calls=10, max_user_turns=3))
    # Three replies, then the agent's fourth message ends the conversation unanswered.
    assert (ep.model_calls, ep.user_turns, ep.ended_by) == (4, 3, "user_turns")
    assert len(ep.said_to_user) == 4
    assert [m["content"] for m in user.transcript if m["role"] == "assistant"] == \
        [task.opening] + ["Tell me more."] * 3


def test_an_agent_that_only_calls_tools_meets_the_model_call_limit():
    async def looper(messages, tools):
        return {"content": "", "tool_calls": [call(0, "get_order", order_id="W1111")]}
    task, ep = play(CANCEL_OK, looper, max_model_calls=5)
    assert (ep.model_calls, ep.user_turns, ep.ended_by, ep.said_to_user) == \
        (5, 0, "model_calls", [])
    assert score(ep.db, ep.said_to_user, task) == 0.0


def test_the_scripted_customer_gives_its_address_only_when_asked():
    respond = scripted_reply(parse_task(ADDRESS_OK))
    assert respond("What is the new address?") == "The new address is 60 Bridge Street."
    assert respond("Your order is shipped.") == THANKS and STOP in THANKS
    assert scripted_reply(parse_task(CANCEL_OK))("What is the new address?") == THANKS


def _make_sft_data():
    import importlib.util
    from pathlib import Path
    script = Path(__file__).resolve().parents[3] / \
        "examples/agents/customer_service/make_sft_data.py"
    spec = importlib.util.spec_from_file_location("cs_make_sft_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_worked_episode_gives_an_agent_row_and_the_customers_row():
    from asyncrl.agents.customer_service import POLICY, user_prompt
    agent_row, customer_row = _make_sft_data().episode(ADDRESS_OK)
    agent = agent_row["messages"]
    assert agent[0]["role"] == "system" and agent[0]["content"].startswith(POLICY)
    assert [m["role"] for m in agent[1:]] == ["user", "assistant", "user", "assistant", "user",
                                             "assistant", "user", "assistant"]
    assert agent[-1]["content"] == "The address of order W1111 is now 60 Bridge Street."
    # The customer's side: its own prompt, the agent's messages as user turns, and the
    # scripted customer's replies (written out by hand) as the turns to learn.
    assert customer_row["messages"] == [
        {"role": "system", "content": user_prompt(parse_task(ADDRESS_OK))},
        {"role": "assistant", "content": "Hi, about my order."},
        {"role": "user", "content": "Order W1111 is pending, so its address can be changed. "
                                    "What is the new address?"},
        {"role": "assistant", "content": "The new address is 60 Bridge Street."},
        {"role": "user", "content": "The address of order W1111 is now 60 Bridge Street."},
        {"role": "assistant", "content": THANKS},
    ]
    assert "Your new address is 60 Bridge Street." in customer_row["messages"][0]["content"]


# -- task rows and splits --------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda it: it.pop("metadata"), "no 'metadata' object"),
    (lambda it: it["metadata"].pop("goal_db"), "metadata has no 'goal_db'"),
    (lambda it: it["metadata"].update(kind="exchange"), "kind 'exchange' is not one of"),
    (lambda it: it["metadata"].update(order_id="W4040"), "order 'W4040' is not in the database"),
    (lambda it: it["metadata"].update(facts="$37"), "metadata['facts'] must be"),
    (lambda it: it["metadata"].update(facts=[""]), "facts must be non-empty strings"),
    (lambda it: it["metadata"]["db"].pop("orders"), "metadata['db'] has no 'orders' object"),
])
def test_a_malformed_task_row_is_an_error_naming_what_is_wrong(change, message):
    it = copy.deepcopy(CANCEL_OK)
    change(it)
    with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("$", r"\$")):
        parse_task(it)


def test_an_address_task_without_the_new_address_is_refused():
    it = copy.deepcopy(ADDRESS_OK)
    it["metadata"]["new_address"] = None
    with pytest.raises(TaskError, match="needs metadata\\['new_address'\\]"):
        parse_task(it)


def test_generated_tasks_are_reproducible_disjoint_across_splits_and_solvable():
    train = customer_service_items(120, seed=0)
    assert train == customer_service_items(120, seed=0)
    valid = customer_service_items(40, seed=0, split="valid")
    assert not {i["question"] for i in train} & {i["question"] for i in valid}
    assert len({i["question"] for i in train}) == 120
    allowed = 0
    for it in train + valid:
        task, ep = play(it)
        assert score(ep.db, ep.said_to_user, task) == 1.0
        allowed += task.db != task.goal_db
    assert 0.35 < allowed / 160 < 0.65  # about half the requests are allowed


def test_generator_arguments_are_checked():
    with pytest.raises(ValueError, match="split must be"):
        customer_service_items(2, 0, split="test")
    with pytest.raises(ValueError, match="user must be"):
        customer_service_items(2, 0, user="human")


def test_the_untrained_base_url_sits_beside_v1():
    assert untrained_base_url("http://127.0.0.1:9/v1") == "http://127.0.0.1:9/untrained/v1"
    with pytest.raises(ValueError, match="does not end in /v1"):
        untrained_base_url("http://127.0.0.1:9/api")


# -- the example agent through the proxy -----------------------------------------------


def test_the_example_agent_scores_a_worked_episode_and_trains_only_its_own_turns():
    """The served model answers the agent's three turns with the worked episode and, as
    the customer, thanks it: reward 1, and the captured trajectory is the agent's turns."""
    from asyncrl.agents.proxy import AgentProxy
    from asyncrl.models.tiny import make_tiny_tokenizer
    from scripted_engine import ScriptedEngine

    def hermes(text, name, **args):
        body = json.dumps({"name": name, "arguments": args})
        return f"{text}\n<tool_call>\n{body}\n</tool_call>"

    turns = [hermes("I will look up order W1111.", "get_order", order_id="W1111"),
             hermes("Order W1111 is pending, so it can be cancelled.", "cancel_order",
                    order_id="W1111"),
             "Order W1111 is cancelled. $37 will be refunded.",
             THANKS]  # the customer's reply, through the untrained route
    it = copy.deepcopy(CANCEL_OK)
    it["metadata"]["user"] = "model"
    agent = resolve_agent("examples/agents/customer_service/agent.py:agent")
    tokenizer = make_tiny_tokenizer()

    async def main():
        engine = ScriptedEngine(tokenizer, turns)
        proxy = AgentProxy(engine, tokenizer, "policy", admin_key="admin-key-123")
        await proxy.start("127.0.0.1", 0)
        session = proxy.start_session(task_id=it["id"])
        reward = await agent(proxy.base_url, session.api_key, it)
        proxy.close_session(session, reward=reward)
        stats = proxy.stats()
        await proxy.stop()
        return reward, session, stats

    reward, session, stats = run(main())
    assert reward == 1.0
    assert stats["sessions/untrained_completions"] == 1.0
    assert [c.text for c in session.completions] == turns[:3]
    out = export(session.completions, style="tree", discount=1.0, group_id="g")
    [traj] = out.trajectories
    eos = tokenizer.eos_token_id
    trained = [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]
    assert trained == sum((tokenizer.encode(t) + [eos] for t in turns[:3]), [])
    assert STOP not in tokenizer.decode(trained)
