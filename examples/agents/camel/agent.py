"""A CAMEL `ChatAgent` with a multiply tool (`camel-ai`), trained unchanged through the proxy.

Run as a subprocess agent (agent.command): it reads its task from $ASYNCRL_TASK_FILE, the
model from $OPENAI_BASE_URL and $OPENAI_API_KEY, and prints its reward as its last line.
CAMEL pins pydantic<=2.12 while the OpenAI Agents SDK needs >=2.12.2, so it runs from its
own environment (.venv-camel) and needs nothing of asyncrl: the reward is computed here.

The model is CAMEL's OpenAI-compatible backend pointed at the proxy. CAMEL counts the
conversation's tokens before each step; its default counter (tiktoken) downloads its tables
from the internet, and its Anthropic counter fails on current `anthropic` types, so
`ProxyTokenCounter` asks the proxy's /v1/messages/count_tokens, which counts with the
served model's own tokenizer.
"""

from __future__ import annotations

import json
import os
import re

import httpx
from camel.agents import ChatAgent
from camel.models import ModelFactory
from camel.toolkits import FunctionTool
from camel.types import ModelPlatformType
from camel.utils import BaseTokenCounter

SYSTEM = ("You cannot multiply in your head: always use the multiply tool, "
          "then copy its result into <answer></answer> tags.")
MAX_TOKENS = 48


def multiply(a: float, b: float) -> float:
    r"""Multiply two numbers.

    Args:
        a (float): The first number.
        b (float): The second number.

    Returns:
        float: The product a * b.
    """
    return a * b


class ProxyTokenCounter(BaseTokenCounter):
    """Counts a conversation's tokens with POST /v1/messages/count_tokens on the proxy."""

    def __init__(self, base_url: str, api_key: str):
        self.url = base_url.removesuffix("/v1") + "/v1/messages/count_tokens"
        self.api_key = api_key

    def count_tokens_from_messages(self, messages: list[dict]) -> int:
        system = "\n".join(str(m["content"]) for m in messages if m["role"] == "system")
        turns = [{"role": "assistant" if m["role"] == "assistant" else "user",
                  "content": str(m.get("content") or "")}
                 for m in messages if m["role"] != "system"]
        body = {"model": "policy", "messages": turns or [{"role": "user", "content": ""}]}
        if system:
            body["system"] = system
        r = httpx.post(self.url, json=body, headers={"x-api-key": self.api_key}, timeout=60)
        r.raise_for_status()
        return r.json()["input_tokens"]

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("the proxy counts tokens; it does not hand out ids")

    def decode(self, token_ids: list[int]) -> str:
        raise NotImplementedError("the proxy counts tokens; it does not hand out ids")


def reward(text: str, answer: str) -> float:
    """1.0 when the last <answer> holds the right number, else 0.0."""
    found = re.findall(r"<answer>\s*(.*?)\s*</answer>", text, flags=re.S)
    try:
        return float(bool(found) and float(found[-1].replace(",", "")) == float(answer))
    except ValueError:
        return 0.0


def main() -> None:
    item = json.loads(open(os.environ["ASYNCRL_TASK_FILE"]).read())
    base_url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    model = ModelFactory.create(
        model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL, model_type="policy",
        url=base_url, api_key=key, model_config_dict={"max_tokens": MAX_TOKENS},
        token_counter=ProxyTokenCounter(base_url, key),
        max_retries=0)
    agent = ChatAgent(system_message=SYSTEM, model=model, tools=[FunctionTool(multiply)],
                      max_iteration=3)
    response = agent.step(item["question"])
    text = response.msgs[-1].content if response.msgs else ""
    print(reward(text, item["answer"]))


if __name__ == "__main__":
    main()
