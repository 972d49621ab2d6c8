"""Worked customer-service episodes as SFT rows: a warm start that teaches SmolLM2 the tools.

    python examples/agents/customer_service/make_sft_data.py --out runs/cs_sft.jsonl --size 192

Each row is one training-split task done by `expert` (the policy followed exactly) against
the scripted customer, in the text the proxy shows the model (SmolLM2's template has no
tools, so tools, calls and results are written in the Hermes form): the policy, the
customer's request, a `get_order` lookup and its real result, then either a refusal that
names the order's status or the action's call, its result and the outcome told to the
customer (an address change first asks for the new address).

The served model also plays the customer (`user: model`, through the proxy's untrained
routes), so each episode gives a second row: the customer's side, from the customer's own
prompt (`user_prompt`), with the scripted customer's replies as its turns. Without it the
warm-started model, asked for an address as the customer, answers as an agent would, and
no address change can succeed.

`asyncrl sft` learns every assistant turn of both kinds of row
(`examples/sft/customer_service_sft_cpu.yaml`); the RL run then starts from it
(`customer_service_cpu.yaml actor.path=<checkpoint>`). Held-out tasks are never used.
"""

import argparse
import asyncio
import json
from pathlib import Path

from asyncrl.agents.customer_service import (
    converse,
    customer_service_items,
    expert,
    make_toolbox,
    parse_task,
    score,
    scripted_reply,
    user_prompt,
)
from asyncrl.agents.user import ScriptedUser
from asyncrl.openai.tool_calls import hermes_messages


def episode(item: dict) -> tuple[dict, dict]:
    """One task done right, as two chat rows: the agent's side and the customer's.

    An episode the reward does not pass is a bug.
    """
    task = parse_task(item)
    user = ScriptedUser(task.opening, scripted_reply(task))
    ep = asyncio.run(converse(expert(task), user, task))
    if score(ep.db, ep.said_to_user, task) != 1.0:
        raise AssertionError(f"the expert failed task {item['id']}: {ep.messages}")
    specs = make_toolbox(task.db).specs
    agent_row = {"messages": hermes_messages(ep.messages, specs, None)}
    customer_row = {"messages": [{"role": "system", "content": user_prompt(task)},
                                 *user.transcript]}
    return agent_row, customer_row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=192)
    p.add_argument("--seed", type=int, default=100)  # the RL run draws its tasks with seed 0
    args = p.parse_args()
    items = customer_service_items(args.size, args.seed, split="train", user="scripted")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for item in items:
            for row in episode(item):
                f.write(json.dumps(row) + "\n")
    print(f"{len(items)} worked episodes ({2 * len(items)} rows: agent, customer) -> {out}")


if __name__ == "__main__":
    main()
