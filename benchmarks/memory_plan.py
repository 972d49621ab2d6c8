"""`asyncrl plan`'s trainer-rank estimate against the peak memory of real training steps.

    python benchmarks/memory_plan.py                       # tiny, SmolLM2-135M and 0.6B shapes
    python benchmarks/memory_plan.py --cases tiny smollm2-135m --ranks 1 2
    python benchmarks/memory_plan.py --cases qwen3-0.6b --ranks 2 --tensor 2   # fsdp:d1t2
    python benchmarks/memory_plan.py --cases qwen3-1.7b --lora 32 --steps 1    # LoRA, r 32

Each case runs in fresh processes (one per rank, gloo on the loopback): a random model of a
published shape (config and tokenizer written here, weights drawn at start), a batch of
`--tokens` tokens in one micro-batch, `--steps` optimiser steps (on a CPU the optimiser
state exists from the start), and the peak resident memory of rank 0 (`ru_maxrss`).
`--tensor T` splits each layer over T of the ranks (actor.backend fsdp:d<ranks/T>t<T>);
`--lora R` trains rank-R adapters on every linear layer with the base frozen. The plan's
figure is the sum of its rows (runtime included) for the same shape, layout, dtype, LoRA
and micro-batch. On a CPU every rank is a process on one machine, so "rank 0" is what one
rank takes.

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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = f"fsdp:d{world // args.tensor}t{args.tensor}" if args.tensor > 1 else None
    spec = TrainEngineSpec(path=args.model, dtype=args.dtype, init_from_scratch=True,
                           gradient_checkpointing=args.gradient_checkpointing, backend=backend,
                           use_lora=args.lora > 0, lora_rank=max(args.lora, 1),
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=args.tokens),
                           optimizer=OptimizerConfig(lr=1e-5))
    engine = FSDPTrainEngine(spec, total_steps=args.steps)
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

    for _ in range(args.steps):
        engine.train_batch(batch, loss_fn)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def measure(name: str, ranks: int, args: argparse.Namespace) -> int:
    from asyncrl.trainer.dist import free_port

    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), name)
        port = str(free_port())
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--child", "--model", tmp, "--tokens",
                   str(args.tokens), "--dtype", args.dtype, "--steps", str(args.steps),
                   "--tensor", str(args.tensor), "--lora", str(args.lora)]
            cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name} on {ranks} ranks failed: see the output above")
        return json.loads(outs[0].strip().splitlines()[-1])["peak"]


def predict(name: str, ranks: int, args: argparse.Namespace) -> tuple[int, int]:
    from asyncrl.controller.plan import ModelShape, TrainLayout, plan_trainer

    h, n_layers, heads, kv, hd, inter, vocab, tied = SHAPES[name]
    shape = ModelShape(vocab_size=vocab, hidden_size=h, intermediate_size=inter,
                       num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                       tie_word_embeddings=tied, qk_norm=name.startswith("qwen3"))
    layout = TrainLayout(ranks // args.tensor, args.tensor)
    adapters = shape.lora_params(args.lora) if args.lora else 0
    plan = plan_trainer(shape, layout=layout, device="cpu", tokens_per_mb=args.tokens,
                        gradient_checkpointing=args.gradient_checkpointing, adapters=adapters,
                        compute_bytes=2 if args.dtype == "bfloat16" else 4)
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
    parser.add_argument("--steps", type=int, default=3, help="optimiser steps")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel size t")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full training)")
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"{'shape':<14s}{'layout':>10s}{'lora':>6s}{'params':>10s}{'predicted GiB':>15s}"
          f"{'measured GiB':>14s}{'error':>8s}")
    for name in args.cases:
        for ranks in args.ranks:
            if ranks % args.tensor:
                raise SystemExit(f"--ranks {ranks} is not a multiple of --tensor {args.tensor}")
            layout = f"d{ranks // args.tensor}" + (f"t{args.tensor}" if args.tensor > 1 else "")
            n, predicted = predict(name, ranks, args)
            peak = measure(name, ranks, args)
            print(f"{name:<14s}{layout:>10s}{args.lora or '-':>6}{n / 1e6:>9.0f}M"
                  f"{predicted / 2**30:>15.2f}{peak / 2**30:>14.2f}"
                  f"{(predicted - peak) / peak:>+8.0%}", flush=True)


if __name__ == "__main__":
    main()
