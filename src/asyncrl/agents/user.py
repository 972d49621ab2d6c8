"""Simulated users: the other party of a conversation that an agent is trained to hold.

A user answers each message of the agent with a message of its own, or stops. Two kinds:

- `ModelUser`: a model session on the served model with its own system prompt and
  sampling, reached through the proxy's `/untrained/v1` routes with the agent's session
  key. The proxy records none of its requests, so its tokens never enter a trajectory.
- `ScriptedUser`: a function of the agent's message, for tests and for making worked
  episodes (no model involved).

Both keep the same transcript: the user's side of the conversation, with the roles seen
from the user (its own messages are `assistant`, the agent's are `user`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

STOP = "###STOP###"  # the user is done (tau-bench's convention)


def untrained_base_url(base_url: str) -> str:
    """The base URL of a proxy's untrained routes, from its `.../v1` base URL."""
    if not base_url.rstrip("/").endswith("/v1"):
        raise ValueError(f"base_url {base_url!r} does not end in /v1 (an agent proxy's "
                         "base URL does)")
    return base_url.rstrip("/")[: -len("/v1")] + "/untrained/v1"


def is_stop(message: str) -> bool:
    """Whether a user message ends the conversation."""
    return STOP in message


class User(Protocol):
    """The other party: its first message, then one reply per agent message."""

    opening: str

    async def reply(self, agent_message: str) -> str: ...


class ScriptedUser:
    """A user whose replies are `respond(agent_message)`; its opening message is given."""

    def __init__(self, opening: str, respond: Callable[[str], str]) -> None:
        self.opening = opening
        self.respond = respond
        self.transcript: list[dict[str, str]] = [{"role": "assistant", "content": opening}]

    async def reply(self, agent_message: str) -> str:
        text = self.respond(agent_message)
        self.transcript += [{"role": "user", "content": agent_message},
                            {"role": "assistant", "content": text}]
        return text


class ModelUser:
    """A user played by the served model through the proxy's untrained routes.

    `system` tells the model who it is and what it wants; `opening` is its first message
    (given, so every episode of a task starts from the same request). Each reply samples
    with `temperature` and at most `max_tokens` tokens.
    """

    def __init__(self, base_url: str, api_key: str, *, system: str, opening: str,
                 temperature: float = 0.0, max_tokens: int = 48) -> None:
        from openai import AsyncOpenAI  # the `agents` extra; not needed to import this module

        self.client = AsyncOpenAI(base_url=untrained_base_url(base_url), api_key=api_key)
        self.opening = opening
        self.sampling: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens}
        self.transcript: list[dict[str, str]] = [{"role": "system", "content": system},
                                                 {"role": "assistant", "content": opening}]

    async def reply(self, agent_message: str) -> str:
        self.transcript.append({"role": "user", "content": agent_message})
        out = await self.client.chat.completions.create(
            model="user", messages=self.transcript, **self.sampling)
        text = out.choices[0].message.content or ""
        self.transcript.append({"role": "assistant", "content": text})
        return text

    async def close(self) -> None:
        await self.client.close()
