"""One training step of a quickstart-shaped batch, phase by phase, each lever on and off.

    python benchmarks/train_step.py                                   # tiny random model
    python benchmarks/train_step.py --model smollm2-135m-instruct     # the quickstart's
    python benchmarks/train_step.py --model smollm2-135m-instruct --threads 1 2
    python benchmarks/train_step.py --shape smollm2-1.7b:6 --all-on   # wider layers, random

The step: the proximal log-probs recomputed (a forward without gradient; a run with one
update per batch, as the quickstart, takes them from the training forward instead and skips
it), then forward + backward of the policy loss over the micro-batches, gradient clipping
and the fused AdamW step. For each configuration (threads x shared prefix off/on, and with
shared prefixes on one rank: the model wrapped by FSDP2 as on several ranks, or plain with
bf16 copies of its weights, `trainer/cpu/precision.py`, the default; and the trainer's C
kernels off or on: the log-prob head's, RMSNorm's, the MLP's SwiGLU product's, the rotary
embedding's, the trie attention's moves between nodes and rows and the gradient passes',
`trainer/cpu/logprob_head.py`, `trainer/cpu/norm.py`, `trainer/cpu/mlp.py`, `trainer/cpu/rope.py`,
`trainer/cpu/attention.py` and `trainer/cpu/grad_ops.py`; and freed memory kept
for the next step or handed back as glibc does, `trainer/cpu/heap.py`; and the trie attention
as bf16 matmuls around a C softmax or as SDPA's flash kernel, `trainer/cpu/attention.py`; and
the tied embedding's gradient added into its fp32 master by the head and the lookup or
through autograd, `trainer/cpu/precision.py`; and the linear layers' weight gradients from
contiguous operands or autograd's,
`trainer/cpu/linear.py`) it prints the mean seconds of each phase over --repeats steps, each on
a new batch of the same shape as in a run (after three warm-up steps), the trained tokens
per second (every token of every trajectory, prompt included, per whole step), the model
FLOP utilisation, and the page faults per step (thousands, "kfault"):

    MFU = 6 x non-embedding params x tokens computed / (fwd + bwd + optimiser seconds)
          / the measured bf16 matmul peak of the same number of threads

where "tokens computed" are the batch's real tokens on the padded path and the trie's
distinct nodes on the shared-prefix path (a shared prompt counted once; the padding nodes
that round their count up, `trainer/prefix.py`, not counted). "step MFU" also
counts the recompute forward (2 x params x tokens) over the whole step.

A second table splits forward + backward + optimiser: the matrix products (every mm and bmm
the forwards and backwards run, recorded below autograd in steps of their own), timed inside
the step and each run on its own at its recorded shapes and strides; the optimiser; the
rest (norms, softmaxes, SwiGLU, rotary embedding, moves, residual sums, gradient sums).
Its "bound" is the MFU were every product as fast as alone and the rest free: how far the
step can go on this machine with these products, whatever else is done to it.

`--shape NAME[:LAYERS]` runs the same batch through a random model of a larger published
shape (SmolLM2-360M's or -1.7B's layers, 49k vocabulary; LAYERS of them, default all): how
the utilisation grows with the layers' width on this machine, where the 135M model's hidden
size of 576 keeps every product small. `--all-on` measures only the configuration with every
lever on.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_prefix import batch_arguments, quickstart_batch

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import MicroBatchSpec, TrainEngineSpec
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.cpu.options import CpuPaths, set_cpu_paths
from asyncrl.trainer.microbatch import to_device
from asyncrl.trainer.prefix import pack_prefixes

PHASES = ("collate", "recompute", "forward", "backward", "optimizer")
# Steps run before the measured ones: the process's heap reaches its high-water mark over
# the first two or three (page faults), more so for the larger shapes.
WARM_UP = 3
# Published layer shapes for `--shape` (head_dim 64, a 49,152-token vocabulary, tied).
SHAPES = {
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_layers": 32,
                     "num_heads": 15, "num_kv_heads": 5},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 24,
                     "num_heads": 32, "num_kv_heads": 32},
}


def shaped_model(spec: str, folder: str) -> str:
    """A random bf16 model of SHAPES[name] with `layers` layers, for spec "name[:layers]"."""
    from asyncrl.models.tiny import make_tiny_model

    name, _, layers = spec.partition(":")
    if name not in SHAPES:
        raise SystemExit(f"--shape {spec!r}: the name must be one of {sorted(SHAPES)}")
    shape = dict(SHAPES[name])
    if layers:
        shape["num_layers"] = int(layers)
    path = make_tiny_model(f"{folder}/{name}", head_dim=64, vocab_size=49152, **shape)
    return path


def matmul_peak(threads: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured matmul FLOP/s with `threads` threads: the best single square matmul of a
    few sizes (oneDNN's best case, what no model layer beats)."""
    torch.set_num_threads(threads)
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(10):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def label(config: list) -> str:
    """A configuration's levers in a few words, for the second table."""
    shared, fsdp, kernels, keep, matmul_attention, sink, contiguous = config
    return " ".join([
        "shared" if shared else "padded", "fsdp" if fsdp else "copies", "C" if kernels else "torch",
        "kept" if keep else "glibc", "matmul" if matmul_attention and shared else "flash",
        "sink" if sink and not fsdp else "nosink", "contig" if contiguous else "auto"])


def non_embedding_params(engine: FSDPTrainEngine) -> int:
    hf = engine.model.hf
    embed = {id(hf.get_input_embeddings().weight), id(hf.get_output_embeddings().weight)}
    return sum(p.numel() for p in hf.parameters() if id(p) not in embed)


def one_step(engine: FSDPTrainEngine, batch: TensorBatch,
             record: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
    """Seconds per phase of one step, the way `train_batch` runs it; `record` is entered
    around the forwards and backwards (not the recompute, not the optimiser)."""
    model = engine.model
    times = dict.fromkeys(PHASES, 0.0)
    tick = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal tick
        now = time.perf_counter()
        times[phase] += now - tick
        tick = now

    engine.compute_logprobs(batch)  # includes its own collation: counted as recompute
    lap("recompute")
    model.train()
    n_tokens = int((batch.loss_mask > 0).sum())
    # on one rank, entering `_computing` refreshes the bf16 copies: counted as collate
    with engine._computing(), record or contextlib.nullcontext():
        for rows, _ in engine._my_micro_batches(batch):
            mb = to_device(batch.select(rows), engine.device)
            lap("collate")
            logprobs, _ = engine._train_forward(model, mb, n_tokens)  # packing counted here
            loss = -(logprobs * mb.loss_mask).sum() / n_tokens
            lap("forward")
            loss.backward()
            lap("backward")
    engine._clip_gradients()
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    lap("optimizer")
    return times


MATMULS = {torch.ops.aten.mm.default: "mm", torch.ops.aten.mm.out: "mm",
            torch.ops.aten.bmm.default: "bmm", torch.ops.aten.bmm.out: "bmm",
            torch.ops.aten.addmm.default: "mm", torch.ops.aten.addmm.out: "mm"}


class MatmulRecorder(TorchDispatchMode):
    """Records every matrix product a step runs (below autograd, so backward's too): its op
    and each tensor operand's shape, strides and dtype, counted per distinct signature."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.seconds = 0.0  # their time inside the step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS:
            operands = tuple(("T", tuple(a.shape), a.stride(), a.dtype)
                             if isinstance(a, torch.Tensor) else ("V", a) for a in args)
            out = kwargs.get("out")
            if out is not None:
                out = (tuple(out.shape), out.stride(), out.dtype)
            self.calls[(func, operands, out)] += 1
            start = time.perf_counter()
            result = func(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return result
        return func(*args, **kwargs)


def matmul_flops(func: torch._ops.OpOverload, operands: tuple) -> int:
    """2 x M x N x K (x batch) of a recorded product."""
    shapes = [o[1] for o in operands if o[0] == "T"]
    a, b = shapes[-2], shapes[-1]  # addmm: (bias, a, b)
    if MATMULS[func] == "bmm":
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[0] * a[1] * b[1]


def alone_seconds(signature: tuple, repeats: int = 5) -> float:
    """Median seconds of one recorded product run on its own: fresh operands of the same
    shapes, strides and dtype, warm caches (so no slower than inside the step)."""
    func, operands, out = signature

    def fresh(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
        # random storage of the span the strides reach, viewed as recorded (an expanded
        # gradient's zero strides included)
        span = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        return torch.randn(span, dtype=dtype).as_strided(shape, stride)

    args = [fresh(*o[1:]) if o[0] == "T" else o[1] for o in operands]
    kwargs = {"out": fresh(*out)} if out is not None else {}
    times = []
    for i in range(2 + repeats):
        start = time.perf_counter()
        func(*args, **kwargs)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def computed_tokens(engine: FSDPTrainEngine, batch: TensorBatch) -> tuple[int, int]:
    """(real tokens, trie nodes) over this rank's micro-batches."""
    real = nodes = 0
    for rows, _ in engine._my_micro_batches(batch):
        mb = batch.select(rows)
        real += int(mb.attention_mask.sum())
        nodes += pack_prefixes(mb.input_ids, mb.attention_mask).n_nodes
    return real, nodes


def measure(args: argparse.Namespace, threads: int, shared: bool, fsdp: bool, kernels: bool,
            keep: bool, matmul_attention: bool, sink: bool,
            contiguous: bool) -> dict[str, float]:
    """One configuration's mean phases, tokens and page faults per step, in this process."""
    torch.set_num_threads(threads)
    set_cpu_paths(CpuPaths(
        fsdp_on_one_rank=fsdp, logprob_kernels=kernels, norm_kernels=kernels,
        mlp_kernels=kernels, grad_kernels=kernels, rope_kernels=kernels,
        attention_moves_in_c=kernels, keep_freed_memory=keep, matmul_attention=matmul_attention,
        grads_to_master=sink, contiguous_linear=contiguous))
    spec = TrainEngineSpec(path=args.model, dtype=args.dtype, shared_prefix=shared,
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb),
                           device=args.device)
    engine = FSDPTrainEngine(spec, total_steps=WARM_UP + args.repeats)
    engine.initialize()
    # A new batch each step, as in a run: one batch repeated would hide what a run pays for
    # each new size (oneDNN builds a matmul primitive per shape it has not seen).
    batches = [quickstart_batch(args.groups, args.samples, args.prompt, seed=seed)
               for seed in range(1, WARM_UP + args.repeats + 1)]
    for batch in batches[:WARM_UP]:
        one_step(engine, batch)
    measured = batches[WARM_UP:]
    counts = [computed_tokens(engine, batch) for batch in measured]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    runs = [one_step(engine, batch) for batch in measured]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    # The products these steps ran (forward and backward), each timed on its own.
    recorder = MatmulRecorder()
    for batch in measured:
        one_step(engine, batch, record=recorder)
    alone = {sig: alone_seconds(sig) for sig in recorder.calls}
    steps = len(measured)
    return {**{p: statistics.mean(r[p] for r in runs) for p in PHASES},
            "step": statistics.mean(sum(r.values()) for r in runs),
            "params": non_embedding_params(engine),
            "real": statistics.mean(real for real, _ in counts),
            "nodes": statistics.mean(nodes for _, nodes in counts),
            "faults": faults / args.repeats,
            "mm_in_step": recorder.seconds / steps,
            "mm_alone": sum(alone[sig] * n for sig, n in recorder.calls.items()) / steps,
            "mm_flops": sum(matmul_flops(sig[0], sig[1]) * n
                            for sig, n in recorder.calls.items()) / steps}


def main() -> None:
    parser = batch_arguments(__doc__.split("\n")[0], dtype="bfloat16", max_tokens_per_mb=4096,
                             repeats=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--shape", help="a random model of this shape instead of --model: "
                        f"NAME[:LAYERS], NAME one of {sorted(SHAPES)}")
    parser.add_argument("--all-on", action="store_true",
                        help="only the configuration with every lever on")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one configuration
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, *json.loads(args.one))))
        return

    folder = tempfile.mkdtemp(prefix="asyncrl-train-step-")
    atexit.register(shutil.rmtree, folder, True)
    if args.shape:
        if args.model is not None:
            raise SystemExit("--shape builds its own model: leave out --model")
        args.model = shaped_model(args.shape, folder)
    elif args.model is None:
        from asyncrl.models.tiny import make_tiny_model

        args.model = make_tiny_model(folder + "/tiny")
    peaks = {t: matmul_peak(t) for t in args.threads}
    print(f"batch: {args.groups} groups x {args.samples} samples, prompt {args.prompt}, "
          f"answers 10-40; model {args.model}, {args.dtype}; each configuration in its "
          "own process")
    print("bf16 matmul peak: " + ", ".join(f"{t} thread(s) {peaks[t] / 1e9:.0f} GFLOP/s"
                                           for t in args.threads))
    header = (f"{'threads':>7} {'shared':>6} {'wrap':>6} {'C':>5} {'heap':>5} {'attn':>6} "
              f"{'sink':>5} {'lin':>5} | "
              + " ".join(f"{p:>9}" for p in PHASES)
              + f" | {'step s':>6} {'tok/s':>6} {'MFU':>5} {'stepMFU':>7} {'kfault':>6}")
    print(header)
    print("-" * len(header))
    rows, details = {}, {}
    # (shared prefix, FSDP2 on the one rank, C kernels, freed memory kept, matmul attention,
    # gradient sink, contiguous weight gradients): the later levers one at a time.
    on = (True, False, True, True, True, True, True)
    levers = [(False, *on[1:])] + [
        tuple(not v if i == lever else v for i, v in enumerate(on)) for lever in range(1, 7)
    ] + [on]
    if args.all_on:
        levers = [on]
    argv = ["--model", args.model, "--groups", str(args.groups), "--samples", str(args.samples),
            "--prompt", str(args.prompt), "--dtype", args.dtype, "--repeats", str(args.repeats),
            "--max-tokens-per-mb", str(args.max_tokens_per_mb), "--device", args.device]
    for threads in args.threads:
        for shared, fsdp, kernels, keep, matmul_attention, sink, contiguous in levers:
            config = [threads, shared, fsdp, kernels, keep, matmul_attention, sink, contiguous]
            out = subprocess.run([sys.executable, __file__, *argv, "--one", json.dumps(config)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            computed = r["nodes"] if shared else r["real"]
            train = r["collate"] + r["forward"] + r["backward"] + r["optimizer"]
            mfu = 6 * r["params"] * computed / train / peaks[threads]
            step_mfu = 8 * r["params"] * computed / r["step"] / peaks[threads]
            rows[tuple(config)] = r["step"]
            details[tuple(config)] = r
            print(f"{threads:>7} {'on' if shared else 'off':>6} {'fsdp' if fsdp else 'copies':>6} "
                  f"{'C' if kernels else 'torch':>5} {'kept' if keep else 'glibc':>5} "
                  f"{'matmul' if matmul_attention and shared else 'flash':>6} "
                  f"{'on' if sink and not fsdp else 'off':>5} "
                  f"{'contig' if contiguous else 'auto':>5} | "
                  + " ".join(f"{r[p]:9.3f}" for p in PHASES)
                  + f" | {r['step']:6.2f} {r['real'] / r['step']:6.0f} {mfu:5.1%} "
                  f"{step_mfu:7.1%} {r['faults'] / 1e3:6.0f}", flush=True)
    print(f"tokens per step (mean): real {r['real']:.0f}, trie nodes {r['nodes']:.0f} "
          f"({r['real'] / r['nodes']:.2f}x fewer shared); "
          f"non-embedding params {r['params'] / 1e6:.1f}M")
    print("\nwhere forward + backward + optimiser go (s): the step's matrix products as timed "
          "inside it (a step of its own) and each run alone (their recorded shapes and strides), "
          "the optimiser, the rest; the MFU bound is the MFU were the products as fast as alone "
          "and the rest took no time")
    print(f"{'threads':>7} {'config':>44} | {'train':>6} {'in step':>7} {'alone':>6} {'GF/s':>5} "
          f"{'%peak':>5} {'optim':>6} {'rest':>6} | {'MFU':>5} {'bound':>5}")
    for (threads, *config), r in details.items():
        computed = r["nodes"] if config[0] else r["real"]
        train = r["collate"] + r["forward"] + r["backward"] + r["optimizer"]
        rate = r["mm_flops"] / r["mm_alone"]
        counted = 6 * r["params"] * computed / peaks[threads]
        print(f"{threads:>7} {label(config):>44} | {train:6.3f} {r['mm_in_step']:7.3f} "
              f"{r['mm_alone']:6.3f} {rate / 1e9:5.0f} {rate / peaks[threads]:5.0%} "
              f"{r['optimizer']:6.3f} {train - r['mm_in_step'] - r['optimizer']:6.3f} | "
              f"{counted / train:5.1%} "
              f"{counted / (r['mm_alone'] + r['optimizer']):5.1%}")
    if len(levers) == 1:
        return
    base = rows[(args.threads[0], *levers[0])]
    for (threads, shared, fsdp, kernels, keep, matmul_attention, sink, contiguous), step in (
            rows.items()):
        print(f"speed-up vs {args.threads[0]} thread(s) padded: {threads} thread(s), shared "
              f"prefix {'on' if shared else 'off'}, {'FSDP2' if fsdp else 'bf16 copies'}, "
              f"{'C' if kernels else 'torch'} head and norms, freed memory "
              f"{'kept' if keep else 'as glibc does'}, trie attention "
              f"{'as matmuls' if matmul_attention and shared else 'by flash'}, tied "
              f"embedding's gradient {'to its master' if sink and not fsdp else 'by autograd'}, "
              f"weight gradients {'from contiguous operands' if contiguous else 'as autograd'}: "
              f"{base / step:.2f}x")


if __name__ == "__main__":
    main()
