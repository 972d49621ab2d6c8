"""An OpenAI Agents SDK agent (`openai-agents`), trained unchanged through the proxy.

An `Agent` with one function tool, a calculator, solves arithmetic; the SDK talks to the
model through its default Responses API (POST /v1/responses), which the proxy records
token for token like any chat completion. The only asyncrl-specific lines build the
model client from the session's base_url and key; the agent itself is stock SDK code.

The episode ends when the SDK's run ends: a final answer, too many turns, or a tool call
the SDK cannot parse (the model's own mistake: reward 0). Anything else (the server
failing, a bug) propagates and fails the episode, so it is reported, never scored 0.
"""

from __future__ import annotations

import agents
from openai import AsyncOpenAI

from asyncrl.agents.tools import Calculator
from asyncrl.rewards.rgym import reasoning_gym_reward

agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers
INSTRUCTIONS = ("Use the calculator tool for arithmetic, then give the final answer inside "
                "<answer></answer> tags.")
MAX_TURNS = 3
_calculator = Calculator()


@agents.function_tool
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 123 * 45."""
    return await _calculator({"expression": expression})


async def agent(base_url: str, api_key: str, item: dict) -> float:
    model = agents.OpenAIResponsesModel(
        model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    solver = agents.Agent(name="solver", instructions=INSTRUCTIONS, tools=[calculator],
                          model=model, model_settings=agents.ModelSettings(max_tokens=64))
    try:
        result = await agents.Runner.run(solver, item["question"], max_turns=MAX_TURNS)
    except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):
        return 0.0  # the model did not finish, or called the tool with unparsable arguments
    return reasoning_gym_reward(str(result.final_output), item)
