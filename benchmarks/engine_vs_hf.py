"""Decode throughput of the local engine against HF `generate`, on the same prompts.

    python benchmarks/engine_vs_hf.py --model smollm2-135m-instruct --batch-sizes 1 32

Every sequence generates exactly --new-tokens tokens (EOS ignored on both sides), so the
two sides do the same work; tok/s counts generated tokens over wall time, prefill included.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from asyncrl.api.types import GenerationRequest, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.model import DTYPES
from asyncrl.models.hub import resolve_model_path

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one paragraph.", "How many legs does a spider have?"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` chat prompts of slightly different lengths."""
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def bench_engine(engine: LocalEngine, batch: list[list[int]], new_tokens: int,
                 temperature: float) -> float:
    """Generated tokens per second for `batch`, all submitted at once."""
    # ignore EOS: every sequence makes exactly `new_tokens` tokens
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    start = time.perf_counter()
    for ids in batch:
        engine.submit(GenerationRequest(input_ids=ids, sampling=sampling), lambda r: None)
    while engine.stats()["running"] or engine.stats()["waiting"]:
        engine.step()
    return len(batch) * new_tokens / (time.perf_counter() - start)


def bench_hf(model, tokenizer, batch: list[list[int]], new_tokens: int,
             temperature: float) -> float:
    """The same with HF `generate` (left-padded batch, its default dynamic KV cache)."""
    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": batch}, return_tensors="pt")
    kw = dict(do_sample=False)
    if temperature > 0:
        kw = dict(do_sample=True, temperature=temperature, top_k=0)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=tokenizer.pad_token_id, **kw)
    return len(batch) * new_tokens / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> None:
    """Print tok/s of both sides for each batch size."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    config = LocalEngineConfig(dtype=args.dtype, max_batch_size=max(args.batch_sizes),
                               max_seq_len=512)
    engine = LocalEngine(path, config)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    bench_engine(engine, prompts(engine.tokenizer, 2), 8, args.temperature)  # warm-up
    for n in args.batch_sizes:
        batch = prompts(engine.tokenizer, n)
        ours = bench_engine(engine, batch, args.new_tokens, args.temperature)
        line = f"batch {n:3d}: local engine {ours:8.1f} tok/s"
        if hf is not None:
            theirs = bench_hf(hf, engine.tokenizer, batch, args.new_tokens, args.temperature)
            line += f" | HF generate {theirs:8.1f} tok/s | x{ours / theirs:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
