"""The customer-service example's per-call token budget holds every worked message under
SmolLM2's tokenizer: a budget below the longest one (an address change and its call) cuts
the call off, and no address change can succeed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import transformers
import yaml

from asyncrl.agents.customer_service import customer_service_items
from asyncrl.models.hub import resolve_model_path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/agents/customer_service"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"cs_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_worked_agent_message_fits_the_budget_of_a_model_call():
    tok = transformers.AutoTokenizer.from_pretrained(
        str(resolve_model_path("smollm2-135m-instruct")))
    make_sft_data = _module("make_sft_data")
    lengths = {}
    for item in customer_service_items(48, 100, split="train", user="scripted"):
        agent_row, _ = make_sft_data.episode(item)
        for m in agent_row["messages"]:
            if m["role"] == "assistant":
                lengths[m["content"]] = len(tok(m["content"])["input_ids"])
    longest = max(lengths, key=lengths.get)
    assert '"name": "change_address"' in longest  # the lead-in sentence and the call
    assert 64 < lengths[longest] <= 80
    budget = _module("agent").MAX_TOKENS
    config = yaml.safe_load((EXAMPLE / "customer_service_cpu.yaml").read_text())
    # The proxy gives a call the smaller of the request's max_tokens and the config's.
    assert min(budget, config["gconfig"]["max_new_tokens"]) >= lengths[longest]
