"""What dead inference servers wrote in their logs."""

# The lines a vLLM CPU server wrote when a split prefill met a seeded request (shortened).
VLLM_DEATH = """\
(APIServer pid=1) WARNING [system_utils.py:255] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit. This can cause fd \
limit errors like `OSError: [Errno 24] Too many open files`.
(APIServer pid=1) INFO [api_server.py:100] Starting vLLM server on http://127.0.0.1:8000
(Worker pid=3) ERROR [multiproc_executor.py:1063]   File "gpu_model_runner.py", line 3502
(Worker pid=3) ERROR [multiproc_executor.py:1063]     gen.set_offset(gen.get_offset() - 4)
(Worker pid=3) ERROR [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: Worker failed with error 'CPU Generator \
does not use offset', please check the stack trace above for the root cause
(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: \
EngineCore encountered an issue. See stack trace (above) for the root cause.
"""
CAUSE = "RuntimeError: CPU Generator does not use offset"
