"""Agents: token-exact session capture, the conversation tree, tools, the sandbox, runners.

An agent reaches the model only through the agent proxy (`agents/proxy.py`): a
base_url and a session key. Whatever it does, the trainer gets the exact token ids,
log-probs and weight versions of every completion (`capture.py`).
"""
