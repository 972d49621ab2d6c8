"""What each lever of the local engine's CPU decode gives, side by side in one process.

    python benchmarks/decode_levers.py [--batch-sizes 1 32] [--steps 20]

One decode step of SmolLM2-135M-Instruct (bf16, 2 threads) at a KV length of ~100, for
each way the engine can run, from the plain torch forward to the default:

  torch             torch ops, oneDNN's prepacked matmuls, no C
  per-op C          oneDNN matmuls with the C kernels between them (residual + norm,
                    rotary + attention, SiLU), one call each
  one-call C        our packed AVX512-BF16 matmuls and every other op in one C call
  + 2 MB pages      the same, with weights and KV cache on huge pages (the default)

and the sampler (one token per row from the step's logits, temperature 1): torch ops vs
the C pass. Rounds of all variants alternate and the medians are printed, since this
machine's speed drifts; the ratios are to the torch forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncrl.api.types import SamplingParams
from asyncrl.inference.server import cpu_decode as cpu
from asyncrl.inference.server.model import (
    Transformer,
    Weights,
    hf_shapes,
    read_checkpoint,
)
from asyncrl.inference.server.sampling import SamplingBatch, sample
from asyncrl.models.hub import resolve_model_path


def build(path: str, pack: str | None, kernels: bool, huge: bool) -> Transformer:
    model = Transformer.from_pretrained(path, max_seq_len=512)
    if not kernels:
        model.kernels = None
    saved = cpu._madvise
    if not huge:
        cpu._madvise = lambda: None
    try:
        model.w = Weights(model.cfg, read_checkpoint(path, hf_shapes(model.cfg)), torch.bfloat16,
                          pack=pack)
        model.cache = model.new_cache(32, 512)
    finally:
        cpu._madvise = saved
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=5, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    variants = {"torch": build(path, "onednn", False, False),
                "per-op C": build(path, "onednn", True, False)}
    if variants["per-op C"].kernels is None or not variants["per-op C"].kernels.has_gemm:
        raise SystemExit("the C kernels are not available on this machine (compiler or CPU)")
    variants["one-call C"] = build(path, "asyncrl", True, False)
    variants["+ 2 MB pages"] = build(path, "asyncrl", True, True)
    print(f"{args.model}, bf16, one decode step at KV length 101; ms (tok/s), medians of "
          f"{args.rounds} alternating rounds")
    print(f"{'batch':>5} | " + " | ".join(f"{name:>20}" for name in variants)
          + " | sampler torch -> C")
    for b in args.batch_sizes:
        tokens = torch.randint(0, 1000, (b,), generator=torch.Generator().manual_seed(0))
        positions = torch.full((b,), 100)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, m in variants.items():
                m.decode(tokens, positions, m.cache, 101)
                start = time.perf_counter()
                for _ in range(args.steps):
                    m.decode(tokens, positions, m.cache, 101)
                times[name].append((time.perf_counter() - start) / args.steps)
        logits = variants["torch"].decode(tokens, positions, variants["torch"].cache, 101)
        sb = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * b)
        sampler = {"torch": [], "C": []}
        for _ in range(args.rounds):
            for name, torch_path in (("torch", True), ("C", False)):
                start = time.perf_counter()
                sample(logits.float() if torch_path else logits, sb)  # fp32 takes the torch path
                sampler[name].append(time.perf_counter() - start)
        base = statistics.median(times["torch"])
        cells = []
        for name in variants:
            t = statistics.median(times[name])
            cells.append(f"{t * 1e3:6.2f} ({b / t:6.1f}) x{base / t:4.2f}")
        st, sc = statistics.median(sampler["torch"]), statistics.median(sampler["C"])
        print(f"{b:>5} | " + " | ".join(f"{c:>20}" for c in cells)
              + f" | {st * 1e3:.2f} -> {sc * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
