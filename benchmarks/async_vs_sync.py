"""Synchronous (eta=0) against asynchronous (eta=4) RL on the same workload, in one run.

The asynchronous run twice: with `rollout.admission=demand` (the default: episodes start
only as far ahead as the trainer needs, within eta) and `bound` (as far as eta allows,
AReaL's rule), so the table shows what fresher batches buy in throughput and reward. Each
run has a process of its own: a second run in one process loads its trainer in a moment
(modules imported, model converted) and so waits out its server's start-up in its first
step, which the first run hides behind its imports; run in turn in one process, whichever
ran first looked ~4 s faster.

    python benchmarks/async_vs_sync.py                      # the quickstart task, 20 steps each
    python benchmarks/async_vs_sync.py total_train_steps=30 gconfig.n_samples=8
    python benchmarks/async_vs_sync.py --skip 8 scheduler.share_cores=false

Prints, for each: effective throughput (trained tokens per second of the training loop,
waiting for rollouts included) over the whole loop and over the steps after the first
--skip (the steady state of a long run: the asynchronous run fills its eta+1 batches in
flight first), mean step time, the mean training reward of the last steps, the held-out
greedy reward after training (one evaluator, same items: the final reward to compare), and
the ratios async/sync. Any quickstart key can be overridden as key=value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.observe import read_stats


def run_one(eta: int, fileroot: str, overrides: list[str], skip: int,
            admission: str = "demand") -> dict[str, float]:
    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, [
            "total_train_steps=20", "evaluator.before_training=false",
            "evaluator.after_training=true", "stats_logger.plot=false",
            *overrides,
            f"rollout.max_head_offpolicyness={eta}", f"rollout.admission={admission}",
            f"cluster.fileroot={fileroot}", f"trial_name=eta{eta}-{admission}",
        ])
    t0 = time.monotonic()
    summary = train(cfg)
    wall = time.monotonic() - t0
    stats = read_stats(Path(summary["run_dir"]) / "stats.jsonl")
    rows = [r for r in stats if r["kind"] == "train"]
    evals = [r["eval/reward"] for r in stats if r["kind"] == "eval"]
    if len(rows) <= skip:
        raise SystemExit(f"--skip {skip} leaves no step of {len(rows)}: run more steps "
                         "(total_train_steps=...) or skip fewer")
    step_time = sum(r["perf/step_s"] for r in rows)
    steady = rows[skip:]
    tail = rows[-max(1, len(rows) // 3):]
    return {
        "eta": eta,
        "admission": admission if eta else "-",
        "steps": len(rows),
        "trained_tokens": sum(r["perf/trained_tokens"] for r in rows),
        "train_loop_s": step_time,
        "wall_s": wall,
        "tokens_per_s": sum(r["perf/trained_tokens"] for r in rows) / step_time,
        "steady_tokens_per_s": (sum(r["perf/trained_tokens"] for r in steady)
                                / sum(r["perf/step_s"] for r in steady)),
        "step_s": step_time / len(rows),
        "wait_s": sum(r["perf/wait_batch_s"] for r in rows) / len(rows),
        "final_reward": sum(r["rollout/reward"] for r in tail) / len(tail),
        "held_out": evals[-1] if evals else float("nan"),
        "max_staleness": max(r["rollout/staleness_max"] for r in rows),
        "mean_staleness": sum(r["rollout/staleness_mean"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=int, default=5,
                        help="steps left out of the steady-state figure (default 5: eta+1)")
    parser.add_argument("--one", nargs=3, metavar=("ETA", "ADMISSION", "FILEROOT"),
                        help=argparse.SUPPRESS)  # one run, its figures as JSON (a child)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.one:
        eta, admission, root = args.one
        print(json.dumps(run_one(int(eta), root, args.overrides, args.skip, admission)))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as root:
        for eta, admission in ((0, "demand"), (4, "demand"), (4, "bound")):
            out = subprocess.run(
                [sys.executable, __file__, "--skip", str(args.skip),
                 "--one", str(eta), admission, root, *args.overrides],
                stdout=subprocess.PIPE, text=True, check=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\n eta | admission | steps | trained tok | loop s | tok/s  | tok/s after "
          f"{args.skip:2d} | step s | wait s | train reward (last third) | held-out after "
          "| stale mean / max")
    for r in results:
        print(f" {r['eta']:3d} | {r['admission']:>9} | {r['steps']:5d} "
              f"| {r['trained_tokens']:11.0f} | {r['train_loop_s']:6.1f} "
              f"| {r['tokens_per_s']:6.1f} | {r['steady_tokens_per_s']:14.1f} "
              f"| {r['step_s']:6.2f} | {r['wait_s']:6.2f} | {r['final_reward']:25.3f} "
              f"| {r['held_out']:14.3f} | {r['mean_staleness']:6.2f} / {r['max_staleness']:.0f}")
    sync = results[0]
    for asyn in results[1:]:
        print(f"async ({asyn['admission']}) / sync: "
              f"{asyn['tokens_per_s'] / sync['tokens_per_s']:.2f}x whole loop, "
              f"{asyn['steady_tokens_per_s'] / sync['steady_tokens_per_s']:.2f}x after step "
              f"{args.skip}; held-out after training {asyn['held_out']:.3f} against "
              f"{sync['held_out']:.3f}")


if __name__ == "__main__":
    main()
