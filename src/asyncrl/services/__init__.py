"""HTTP services built on the other packages: the OpenAI-compatible gateway (gateway.py)."""
