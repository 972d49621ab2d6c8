"""The `local` inference engine: the code that runs inside its server process.

model.py (decoder forward + slot KV cache; cpu_decode.py binds the C decode step of
`asyncrl.kernels`), sampling.py, engine.py (`LocalEngine`: continuous batching,
interruptible weight updates), memory.py (KV-cache slots from a memory share),
local_backend.py (the engine seen from asyncio, for the OpenAI routes), app.py (aiohttp:
`python -m asyncrl.inference.server.app`), bench.py (in-process benchmark).
The OpenAI routes it mounts live in `asyncrl.openai`; its client is
`asyncrl.inference.client.local`.
"""
