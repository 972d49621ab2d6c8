"""The `local` inference engine: the code that runs inside its server process.

model.py (decoder forward + slot KV cache; cpu.py binds the C decode step in kernels/),
sampling.py, engine.py (`LocalEngine`: continuous batching, interruptible weight
updates), local_backend.py (the engine seen from asyncio, for the OpenAI routes),
server.py (aiohttp: `python -m asyncrl.engine.server`), bench.py (in-process benchmark).
vllm_worker.py runs inside vLLM's workers instead (the receiving side of our weight
reload, loaded by name with --worker-extension-cls).
The OpenAI routes it mounts live in `asyncrl.services`; its client is
`asyncrl.inference.client`.
"""
