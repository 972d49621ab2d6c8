"""Shared by the vLLM tests: skip without vllm, and HF float32 references."""

import importlib.util

import pytest
import torch

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'asyncrl[vllm]')")


def hf_logprobs(model_path: str, prompt: list[int], output: list[int],
                temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each `output` token after prompt + the outputs before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def hf_greedy(model_path: str, prompt: list[int], n: int) -> list[int]:
    """The first `n` greedy tokens of the model after `prompt` (EOS not special)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def generated_tokens(address: str) -> float:
    """vLLM's count of generated tokens so far, from its Prometheus /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{address}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("vllm:generation_tokens_total"))
