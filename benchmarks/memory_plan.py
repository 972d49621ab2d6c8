"""`asyncrl plan`'s trainer-rank estimate against the peak memory of real training steps.

    python benchmarks/memory_plan.py                       # tiny, SmolLM2-135M and 0.6B shapes
    python benchmarks/memory_plan.py --cases tiny smollm2-135m --ranks 1 2

Each case runs in fresh processes (one per rank, gloo on the loopback): a random model of a
published shape (config and tokenizer written here, weights drawn at start), a batch of
`--tokens` tokens in one micro-batch, three optimiser steps (the optimiser state exists from
the first), and the peak resident memory of rank 0 (`ru_maxrss`). The plan's figure is the
sum of its rows (runtime included) for the same shape, ranks, dtype and micro-batch. On a
CPU every rank is a process on one machine, so "rank 0" is what one rank takes.

It prints one row per case: parameters, predicted and measured GiB, and the error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

# Published shapes: (hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied).
SHAPES = {
    "tiny": (64, 2, 2, 1, 32, 128, 320, True),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, True),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
}


def write_model(folder: Path, name: str) -> None:
    """Config (Qwen3 for the qwen3 shapes, else Llama) and a byte tokenizer; no weights."""
    import transformers

    from asyncrl.models.tiny import make_tiny_tokenizer

    h, n_layers, heads, kv, hd, inter, vocab, tied = SHAPES[name]
    kind = (transformers.Qwen3Config if name.startswith("qwen3") else transformers.LlamaConfig)
    kind(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=n_layers,
         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
         tie_word_embeddings=tied, max_position_embeddings=4096).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)


def child(args: argparse.Namespace) -> None:
    """One rank: three training steps; prints its peak RSS in bytes (rank 0)."""
    import torch

    from asyncrl.api.types import TensorBatch
    from asyncrl.config.engine import MicroBatchSpec, OptimizerConfig, TrainEngineSpec
    from asyncrl.trainer import FSDPTrainEngine
    from asyncrl.trainer.dist import init_process_group

    torch.set_num_threads(1)
    init_process_group("cpu")
    spec = TrainEngineSpec(path=args.model, dtype=args.dtype, init_from_scratch=True,
                           gradient_checkpointing=args.gradient_checkpointing,
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=args.tokens),
                           optimizer=OptimizerConfig(lr=1e-5))
    engine = FSDPTrainEngine(spec, total_steps=3)
    engine.initialize()
    vocab = engine.model.hf.config.vocab_size
    rows, length = max(1, args.tokens // 512), min(args.tokens, 512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    batch = TensorBatch(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
                        loss_mask=torch.ones_like(ids, dtype=torch.float32),
                        behavior_logprobs=torch.zeros(ids.shape),
                        versions=torch.zeros_like(ids), rewards=torch.zeros(rows))

    def loss_fn(logprobs, mb, *, n_tokens, n_seqs):
        return -(logprobs * mb.loss_mask).sum() / n_tokens, {}

    for _ in range(3):
        engine.train_batch(batch, loss_fn)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def measure(name: str, ranks: int, tokens: int, dtype: str, checkpointing: bool) -> int:
    from asyncrl.trainer.dist import free_port

    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), name)
        port = str(free_port())
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--child", "--model", tmp, "--tokens", str(tokens),
                   "--dtype", dtype] + (["--gradient-checkpointing"] if checkpointing else [])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name} on {ranks} ranks failed: see the output above")
        return json.loads(outs[0].strip().splitlines()[-1])["peak"]


def predict(name: str, ranks: int, tokens: int, dtype: str, checkpointing: bool) -> tuple:
    from asyncrl.controller.plan import ModelShape, plan_trainer

    h, n_layers, heads, kv, hd, inter, vocab, tied = SHAPES[name]
    shape = ModelShape(vocab_size=vocab, hidden_size=h, intermediate_size=inter,
                       num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                       tie_word_embeddings=tied, qk_norm=name.startswith("qwen3"))
    plan = plan_trainer(shape, world_size=ranks, device="cpu", tokens_per_mb=tokens,
                        gradient_checkpointing=checkpointing,
                        compute_bytes=2 if dtype == "bfloat16" else 4)
    return shape.n_params, sum(plan.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", default=["tiny", "smollm2-135m", "qwen3-0.6b"],
                        choices=sorted(SHAPES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"{'shape':<14s}{'ranks':>6s}{'params':>10s}{'predicted GiB':>15s}"
          f"{'measured GiB':>14s}{'error':>8s}")
    for name in args.cases:
        for ranks in args.ranks:
            n, predicted = predict(name, ranks, args.tokens, args.dtype,
                                   args.gradient_checkpointing)
            peak = measure(name, ranks, args.tokens, args.dtype, args.gradient_checkpointing)
            print(f"{name:<14s}{ranks:>6d}{n / 1e6:>9.0f}M{predicted / 2**30:>15.2f}"
                  f"{peak / 2**30:>14.2f}{(predicted - peak) / peak:>+8.0%}", flush=True)


if __name__ == "__main__":
    main()
