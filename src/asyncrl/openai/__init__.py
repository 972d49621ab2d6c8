"""The OpenAI-compatible layer, mounted by the engine's server, the gateway and the agent proxy.

routes.py (the /v1 routes), protocol.py (request shapes, chat templates), tool_calls.py,
detokenize.py; responses.py and anthropic.py translate onto chat (shapes_base.py);
drift.py checks that a chat template extends each turn token for token. The gateway, an
OpenAI-compatible front of any backend, is `asyncrl.inference.gateway`.
"""
