"""One training step of a quickstart-shaped batch, phase by phase, each lever on and off.

    python benchmarks/train_step.py                                   # tiny random model
    python benchmarks/train_step.py --model smollm2-135m-instruct     # the quickstart's
    python benchmarks/train_step.py --model smollm2-135m-instruct --threads 1 2

The step: the proximal log-probs recomputed (a forward without gradient; a run with one
update per batch, as the quickstart, takes them from the training forward instead and skips
it), then forward + backward of the policy loss over the micro-batches, gradient
clipping and the fused AdamW step. For each configuration (threads x shared prefix off/on,
and with shared prefixes on one rank: the model wrapped by FSDP2 as on several ranks, or
plain with bf16 copies of its weights, `training/precision.py`, the default; and the
trainer's C kernels off or on: the log-prob head's and RMSNorm's, `training/logprob_head.py`
and `training/norm.py`) it prints the median seconds of each phase, the trained tokens per
second (every token of every trajectory, prompt included, per whole step), and the model
FLOP utilisation:

    MFU = 6 x non-embedding params x tokens computed / (fwd + bwd + optimiser seconds)
          / the measured bf16 matmul peak of the same number of threads

where "tokens computed" are the batch's real tokens on the padded path and the trie's
distinct nodes on the shared-prefix path (a shared prompt counted once). "step MFU" also
counts the recompute forward (2 x params x tokens) over the whole step.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_prefix import batch_arguments, quickstart_batch

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import MicroBatchSpec, TrainEngineSpec
from asyncrl.training import FSDPTrainEngine, logprob_head, norm
from asyncrl.training import engine as engine_module
from asyncrl.training.microbatch import to_device
from asyncrl.training.prefix import pack_prefixes

PHASES = ("collate", "recompute", "forward", "backward", "optimizer")


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


def non_embedding_params(engine: FSDPTrainEngine) -> int:
    hf = engine.model.hf
    embed = {id(hf.get_input_embeddings().weight), id(hf.get_output_embeddings().weight)}
    return sum(p.numel() for p in hf.parameters() if id(p) not in embed)


def one_step(engine: FSDPTrainEngine, batch: TensorBatch) -> dict[str, float]:
    """Seconds per phase of one step, the way `train_batch` runs it."""
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
    with engine._computing():  # on one rank: the bf16 copies' refresh, counted as collate
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


def computed_tokens(engine: FSDPTrainEngine, batch: TensorBatch) -> tuple[int, int]:
    """(real tokens, trie nodes) over this rank's micro-batches."""
    real = nodes = 0
    for rows, _ in engine._my_micro_batches(batch):
        mb = batch.select(rows)
        real += int(mb.attention_mask.sum())
        nodes += pack_prefixes(mb.input_ids, mb.attention_mask).n_nodes
    return real, nodes


def main() -> None:
    parser = batch_arguments(__doc__.split("\n")[0], dtype="bfloat16", max_tokens_per_mb=4096,
                             repeats=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    args = parser.parse_args()

    if args.model is None:
        from asyncrl.models.tiny import make_tiny_model

        args.model = make_tiny_model(tempfile.mkdtemp() + "/tiny")
    batch = quickstart_batch(args.groups, args.samples, args.prompt)
    peaks = {t: matmul_peak(t) for t in args.threads}
    print(f"batch: {args.groups} groups x {args.samples} samples, prompt {args.prompt}, "
          f"answers 10-40; model {args.model}, {args.dtype}")
    print("bf16 matmul peak: " + ", ".join(f"{t} thread(s) {peaks[t] / 1e9:.0f} GFLOP/s"
                                           for t in args.threads))
    header = (f"{'threads':>7} {'shared':>6} {'wrap':>6} {'C':>5} | "
              + " ".join(f"{p:>9}" for p in PHASES)
              + f" | {'step s':>6} {'tok/s':>6} {'MFU':>5} {'stepMFU':>7}")
    print(header)
    print("-" * len(header))
    rows = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        # (shared prefix, FSDP2 on the one rank, C head): the later levers one at a time
        for shared, fsdp, kernels in ((False, False, True), (True, True, True),
                                      (True, False, False), (True, False, True)):
            engine_module.FSDP_ON_ONE_RANK = fsdp
            logprob_head.USE_KERNELS = norm.USE_KERNELS = kernels
            spec = TrainEngineSpec(path=args.model, dtype=args.dtype, shared_prefix=shared,
                                   mb_spec=MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb))
            engine = FSDPTrainEngine(spec, total_steps=args.repeats + 1)
            engine.initialize()
            params = non_embedding_params(engine)
            real, nodes = computed_tokens(engine, batch)
            computed = nodes if shared else real
            one_step(engine, batch)  # warm-up
            runs = [one_step(engine, batch) for _ in range(args.repeats)]
            engine.destroy()
            engine_module.FSDP_ON_ONE_RANK = False
            logprob_head.USE_KERNELS = norm.USE_KERNELS = True
            phase = {p: statistics.median(r[p] for r in runs) for p in PHASES}
            step = statistics.median(sum(r.values()) for r in runs)
            train = phase["collate"] + phase["forward"] + phase["backward"] + phase["optimizer"]
            mfu = 6 * params * computed / train / peaks[threads]
            step_mfu = 8 * params * computed / step / peaks[threads]
            rows[threads, shared, fsdp, kernels] = step
            print(f"{threads:>7} {'on' if shared else 'off':>6} {'fsdp' if fsdp else 'copies':>6} "
                  f"{'C' if kernels else 'torch':>5} | "
                  + " ".join(f"{phase[p]:9.3f}" for p in PHASES)
                  + f" | {step:6.2f} {real / step:6.0f} {mfu:5.1%} {step_mfu:7.1%}")
    print(f"tokens: real {real}, trie nodes {nodes} ({real / nodes:.2f}x fewer shared); "
          f"non-embedding params {params / 1e6:.1f}M")
    base = rows[args.threads[0], False, False, True]
    for (threads, shared, fsdp, kernels), step in rows.items():
        print(f"speed-up vs {args.threads[0]} thread(s) padded: {threads} thread(s), shared "
              f"prefix {'on' if shared else 'off'}, {'FSDP2' if fsdp else 'bf16 copies'}, "
              f"{'C' if kernels else 'torch'} head and norms: {base / step:.2f}x")


if __name__ == "__main__":
    main()
