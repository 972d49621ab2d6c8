"""A small tau2-style customer-service domain: a retail order database, tools, a policy.

A task is a customer's goal about one of their orders (cancel it, change its shipping
address, refund it), the database the conversation starts from, the database a correct
agent leaves (`goal_db`), and the facts the customer must be told (`facts`). The agent
looks the order up, acts if the written policy allows it or refuses if not, and tells the
customer the outcome; the customer (a `asyncrl.agents.user` user) answers each message
until it is satisfied or the turn limit.

The tools do what they are told: the policy (only pending orders may be cancelled or
re-addressed, only delivered ones refunded) is in the agent's prompt, not in the tools, so
an agent that breaks it changes the database and its episode scores 0, as tau2 scores it:
reward 1 when the final database equals the goal and every fact appears in what the agent
said to the customer, else 0.

Tasks are generated from a seed; each task's opening message is in the held-out split or
not by a hash of its text, so train and held-out sets never share a request.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.tools import ToolBox, _object_schema
from asyncrl.agents.user import STOP, User, is_stop

KINDS = ("cancel", "address", "refund")
STATUSES = ("pending", "shipped", "delivered")
# What each request needs the order's status to be (the policy).
ALLOWED = {"cancel": "pending", "address": "pending", "refund": "delivered"}
_ITEMS = ["lamp", "kettle", "backpack", "desk chair", "blender", "rain jacket", "toaster",
          "headphones", "yoga mat", "teapot", "bookshelf", "umbrella"]
_STREETS = ["Oak Street", "Elm Road", "Mill Lane", "Park Avenue", "River Road", "Hill Street",
            "Church Lane", "Station Road", "Maple Drive", "Bridge Street"]
HELD_OUT_FRACTION = 0.2

POLICY = """You are a customer service agent of an online shop. \
Use the tools to read and change orders.
Policy:
- Always look the order up with get_order first.
- Only a pending order can be cancelled or have its address changed.
- Only a delivered order can be refunded.
- If the policy does not allow the request, do not change the order: tell the customer its status.
- Tell the customer the outcome in one message without a tool call."""


class TaskError(ValueError):
    """A task row that cannot be run: what is missing or wrong, and where."""


# -- database and tools -----------------------------------------------------------------


def _order_text(order_id: str, order: dict[str, Any]) -> str:
    return (f"Order {order_id}: status {order['status']}, item {order['item']}, "
            f"total ${order['total']}, address {order['address']}.")


class _OrderTool:
    """A tool on one episode's database; its mistakes come back as text for the model."""

    name = ""
    description = ""
    parameters: dict[str, Any] = _object_schema({"order_id": {
        "type": "string", "description": "the order id, such as W1234"}})
    deterministic = False  # each session changes its own database

    def __init__(self, db: dict[str, Any]) -> None:
        self.db = db

    async def __call__(self, args: dict[str, Any]) -> str:
        order_id = args["order_id"].strip().upper()
        order = self.db["orders"].get(order_id)
        if order is None:
            return f"error: there is no order {order_id}"
        return self.run(order_id, order, args)

    def run(self, order_id: str, order: dict[str, Any], args: dict[str, Any]) -> str:
        raise NotImplementedError


class GetOrder(_OrderTool):
    name = "get_order"
    description = "Look up an order: its status, item, total and shipping address."

    def run(self, order_id, order, args):
        return _order_text(order_id, order)


class CancelOrder(_OrderTool):
    name = "cancel_order"
    description = "Cancel an order; its total is refunded."

    def run(self, order_id, order, args):
        if order["status"] in ("cancelled", "refunded"):
            return f"error: order {order_id} is already {order['status']}"
        order["status"] = "cancelled"
        return f"Order {order_id} is cancelled. ${order['total']} will be refunded."


class ChangeAddress(_OrderTool):
    name = "change_address"
    description = "Change the shipping address of an order."
    parameters = _object_schema({
        "order_id": {"type": "string", "description": "the order id, such as W1234"},
        "address": {"type": "string", "description": "the new shipping address"}})

    def run(self, order_id, order, args):
        address = args["address"].strip()
        if not address:
            return "error: the address is empty"
        order["address"] = address
        return f"The address of order {order_id} is now {address}."


class RefundOrder(_OrderTool):
    name = "refund_order"
    description = "Refund an order; its total is paid back."

    def run(self, order_id, order, args):
        if order["status"] in ("cancelled", "refunded"):
            return f"error: order {order_id} is already {order['status']}"
        order["status"] = "refunded"
        return f"Order {order_id} is refunded. ${order['total']} will be paid back."


def make_toolbox(db: dict[str, Any]) -> ToolBox:
    """The four tools, all acting on `db` (changed in place)."""
    return ToolBox([GetOrder(db), CancelOrder(db), ChangeAddress(db), RefundOrder(db)])


# -- tasks ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Task:
    """One customer's goal, checked when read from an item's `metadata`."""

    kind: str
    order_id: str
    db: dict[str, Any]
    goal_db: dict[str, Any]
    facts: list[str]
    opening: str
    new_address: str | None = None  # the address the customer gives when asked


def _require(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in meta:
        raise TaskError(f"{where}: metadata has no {key!r}")
    if not isinstance(meta[key], kind):
        raise TaskError(f"{where}: metadata[{key!r}] must be {kind}, got "
                        f"{type(meta[key]).__name__}")
    return meta[key]


def parse_task(item: dict[str, Any]) -> Task:
    """The task of a dataset item; TaskError naming the field if it is malformed."""
    where = f"customer-service item {item.get('id', '?')!r}"
    meta = item.get("metadata")
    if not isinstance(meta, dict):
        raise TaskError(f"{where}: no 'metadata' object")
    kind = _require(meta, "kind", str, where)
    if kind not in KINDS:
        raise TaskError(f"{where}: kind {kind!r} is not one of {KINDS}")
    db, goal = _require(meta, "db", dict, where), _require(meta, "goal_db", dict, where)
    for name, d in (("db", db), ("goal_db", goal)):
        if not isinstance(d.get("orders"), dict):
            raise TaskError(f"{where}: metadata[{name!r}] has no 'orders' object")
    order_id = _require(meta, "order_id", str, where)
    if order_id not in db["orders"]:
        raise TaskError(f"{where}: order {order_id!r} is not in the database")
    facts = _require(meta, "facts", list, where)
    if not all(isinstance(f, str) and f for f in facts):
        raise TaskError(f"{where}: facts must be non-empty strings")
    new_address = meta.get("new_address")
    if kind == "address" and not isinstance(new_address, str):
        raise TaskError(f"{where}: an address task needs metadata['new_address'] (a string)")
    if not isinstance(item.get("question"), str):
        raise TaskError(f"{where}: no 'question' (the customer's opening message)")
    return Task(kind=kind, order_id=order_id, db=db, goal_db=goal, facts=list(facts),
                opening=item["question"], new_address=new_address)


def opening_message(kind: str, order_id: str) -> str:
    """The customer's first message (an address task leaves the new address for later)."""
    return {"cancel": f"Hi, please cancel my order {order_id}.",
            "address": f"Hi, I want to change the shipping address of my order {order_id}.",
            "refund": f"Hi, I would like a refund for my order {order_id}."}[kind]


def outcome(kind: str, order: dict[str, Any], new_address: str | None) -> tuple[dict, list[str]]:
    """The order as a correct agent leaves it, and the facts the customer must hear."""
    if order["status"] != ALLOWED[kind]:
        return dict(order), [order["status"]]  # refused: the customer learns why
    if kind == "address":
        return {**order, "address": new_address}, [new_address]
    status = "cancelled" if kind == "cancel" else "refunded"
    return {**order, "status": status}, [f"${order['total']}"]


def held_out_request(question: str) -> bool:
    """Whether an opening message is in the held-out split (a stable hash)."""
    digest = hashlib.sha256(f"customer-service-split:{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT_FRACTION * 2**64


def _make_task(rng: random.Random, n_orders: int) -> dict[str, Any]:
    ids = set()
    while len(ids) < n_orders:
        ids.add(f"W{rng.randrange(1000, 10000)}")
    orders = {i: {"status": rng.choice(STATUSES), "item": rng.choice(_ITEMS),
                  "total": rng.randrange(5, 200),
                  "address": f"{rng.randrange(1, 100)} {rng.choice(_STREETS)}"}
              for i in sorted(ids)}
    order_id = rng.choice(sorted(ids))
    kind = rng.choice(KINDS)
    # Half the requests are allowed: the order's status decides, not the kind of request.
    forbidden = [s for s in STATUSES if s != ALLOWED[kind]]
    orders[order_id]["status"] = ALLOWED[kind] if rng.random() < 0.5 else rng.choice(forbidden)
    new_address = None
    if kind == "address":
        while new_address in (None, orders[order_id]["address"]):
            new_address = f"{rng.randrange(1, 100)} {rng.choice(_STREETS)}"
    goal = copy.deepcopy(orders)
    goal[order_id], facts = outcome(kind, orders[order_id], new_address)
    return {"kind": kind, "order_id": order_id, "db": {"orders": orders},
            "goal_db": {"orders": goal}, "facts": facts, "new_address": new_address}


def customer_service_items(size: int, seed: int, split: str = "train", n_orders: int = 3,
                           user: str = "model", **_: Any) -> list[dict[str, Any]]:
    """`size` tasks of `split` drawn with `seed`; `user`: "model" or "scripted" customer."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    if user not in ("model", "scripted"):
        raise ValueError(f"user must be 'model' or 'scripted', got {user!r}")
    if n_orders < 1:
        raise ValueError(f"n_orders must be >= 1, got {n_orders}")
    rng = random.Random(f"customer-service-{split}-{seed}")
    items, seen = [], set()
    while len(items) < size:
        meta = _make_task(rng, n_orders)
        question = opening_message(meta["kind"], meta["order_id"])
        if question in seen or held_out_request(question) != (split == "valid"):
            continue
        seen.add(question)
        items.append({"id": f"cs-{split}-{seed}-{len(items)}", "question": question,
                      "task": "customer_service", "metadata": {**meta, "user": user}})
    return items


# -- the customer -----------------------------------------------------------------------

THANKS = f"Thank you, that is all. {STOP}"


def scripted_reply(task: Task) -> Callable[[str], str]:
    """A customer that gives its new address when asked for an address, else stops."""
    def respond(agent_message: str) -> str:
        if task.new_address is not None and "address?" in agent_message.lower():
            return f"The new address is {task.new_address}."
        return THANKS
    return respond


def user_prompt(task: Task) -> str:
    """The system prompt of a model-played customer."""
    knows = f" Your new address is {task.new_address}." if task.new_address else ""
    return (f"You are a customer talking to a shop's support agent about your order "
            f"{task.order_id}. You wrote: \"{task.opening}\"{knows} Answer the agent's "
            f"questions in one short sentence. When the agent has told you the outcome, "
            f"reply exactly: {THANKS}")


# -- the conversation and its reward ----------------------------------------------------

Policy = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Awaitable[dict[str, Any]]]


@dataclass
class Episode:
    """What happened: the agent's messages (the model's view), what the customer heard."""

    messages: list[dict[str, Any]]
    db: dict[str, Any]
    said_to_user: list[str] = field(default_factory=list)
    user_turns: int = 0
    model_calls: int = 0
    ended_by: str = ""  # "user" | "model_calls" | "user_turns"


async def converse(policy: Policy, user: User, task: Task, *, max_model_calls: int = 6,
                   max_user_turns: int = 3) -> Episode:
    """Alternate agent and customer turns until the customer stops or a limit is reached.

    An agent turn is model calls with tool calls until a message without one, which goes
    to the customer; the customer's reply (or its stop) follows.
    """
    db = copy.deepcopy(task.db)
    toolbox = make_toolbox(db)
    messages: list[dict[str, Any]] = [{"role": "system", "content": POLICY},
                                      {"role": "user", "content": user.opening}]
    ep = Episode(messages=messages, db=db)
    while True:
        if ep.model_calls == max_model_calls:
            ep.ended_by = "model_calls"
            return ep
        message = await policy(messages, toolbox.specs)
        ep.model_calls += 1
        calls = message.get("tool_calls") or []
        messages.append({"role": "assistant", "content": message.get("content") or "",
                         **({"tool_calls": calls} if calls else {})})
        if calls:
            messages += await toolbox.run_tool_calls(calls)
            continue
        ep.said_to_user.append(message.get("content") or "")
        if ep.user_turns == max_user_turns:
            ep.ended_by = "user_turns"
            return ep
        reply = await user.reply(message.get("content") or "")
        ep.user_turns += 1
        if is_stop(reply):
            ep.ended_by = "user"
            return ep
        messages.append({"role": "user", "content": reply})


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w$ ]", " ", text.lower()).split())


def facts_given(said: list[str], facts: list[str]) -> bool:
    """Whether every fact appears in what the agent said to the customer (case and
    punctuation ignored, words whole)."""
    heard = f" {_norm(' '.join(said))} "
    return all(f" {_norm(fact)} " in heard for fact in facts)


def score(db: dict[str, Any], said: list[str], task: Task) -> float:
    """tau2's reward: 1.0 if the database equals the goal and every fact was told, else 0."""
    return float(db == task.goal_db and facts_given(said, task.facts))


# -- the worked agent (warm-start data, tests) ------------------------------------------


def call(i: int, name: str, **args: str) -> dict[str, Any]:
    """An OpenAI tool call."""
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


_ACTION = {"cancel": "cancel_order", "address": "change_address", "refund": "refund_order"}
_VERB = {"cancel": "it can be cancelled", "address": "its address can be changed",
         "refund": "it can be refunded"}
_NOT = {"cancel": "it cannot be cancelled", "address": "its address cannot be changed",
        "refund": "it cannot be refunded"}


def expert(task: Task) -> Policy:
    """The policy that follows POLICY exactly (the customer must give an address when asked).

    Every turn says what it is doing before its call, and the turn after a lookup states
    the status and the decision it implies, so the warm-started model copies a decision
    from words it has just written.
    """
    async def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict:
        n = sum(m["role"] == "assistant" for m in messages)
        oid, last = task.order_id, messages[-1]
        if n == 0:
            return {"content": f"I will look up order {oid}.",
                    "tool_calls": [call(0, "get_order", order_id=oid)]}
        status = task.db["orders"][oid]["status"]
        if n == 1 and status != ALLOWED[task.kind]:
            return {"content": f"Order {oid} is {status}, so {_NOT[task.kind]}."}
        if n == 1 and task.kind == "address":
            return {"content": f"Order {oid} is {status}, so {_VERB[task.kind]}. "
                               "What is the new address?"}
        if n == 1:
            return {"content": f"Order {oid} is {status}, so {_VERB[task.kind]}.",
                    "tool_calls": [call(n, _ACTION[task.kind], order_id=oid)]}
        if last["role"] == "user":  # the customer gave the new address
            return {"content": f"I will change the address of order {oid} to "
                               f"{task.new_address}.",
                    "tool_calls": [call(n, "change_address", order_id=oid,
                                        address=task.new_address or "")]}
        return {"content": last["content"]}  # the action's result, told to the customer
    return policy

