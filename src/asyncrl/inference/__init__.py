"""Inference: our own engine and its server (`server/`), the clients of every backend's
servers (`client/`), and the router that puts many servers behind one address
(`router.py`, `python -m asyncrl.inference.router`)."""
