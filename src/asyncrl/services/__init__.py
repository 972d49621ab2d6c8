"""The OpenAI layer and the HTTP services built on the other packages.

OpenAI layer, mounted by the engine's server, the gateway and the agent proxy:
openai_api.py (routes), openai_protocol.py (request shapes, chat templates),
tool_calls.py, detokenize.py; responses_api.py and anthropic_api.py translate onto chat
(shapes_base.py). Services: gateway.py (OpenAI-compatible front of any backend),
agent_proxy.py, training.py (the training service). http.py serves an aiohttp app
until a signal, for all of them.
"""
