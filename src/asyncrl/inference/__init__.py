"""Inference: our own engine and its server (`server/`), the clients of every backend's
servers (`client/`), and two processes in front of servers: the router, many servers behind
one address (`python -m asyncrl.inference.router`), and the gateway, the OpenAI routes over
any backend (`python -m asyncrl.inference.gateway`)."""
