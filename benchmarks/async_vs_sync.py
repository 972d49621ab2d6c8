"""Synchronous (eta=0) against asynchronous (eta=4) RL on the same workload, in one run.

    python benchmarks/async_vs_sync.py                      # the quickstart task, 12 steps each
    python benchmarks/async_vs_sync.py total_train_steps=20 gconfig.n_samples=8

Prints, for each: effective throughput (trained tokens per second of wall time, waiting
for rollouts included), mean step time, the mean training reward of the last steps, and
the ratio async/sync. Any quickstart key can be overridden as key=value.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from importlib import resources
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.observe import read_stats
from asyncrl.trainers.rl import train


def run_one(eta: int, fileroot: str, overrides: list[str]) -> dict[str, float]:
    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, [
            "total_train_steps=12", "evaluator.before_training=false",
            "evaluator.after_training=false", "stats_logger.plot=false",
            *overrides,
            f"rollout.max_head_offpolicyness={eta}", f"cluster.fileroot={fileroot}",
            f"trial_name=eta{eta}",
        ])
    t0 = time.monotonic()
    summary = train(cfg)
    wall = time.monotonic() - t0
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    step_time = sum(r["perf/step_s"] for r in rows)
    tail = rows[-max(1, len(rows) // 3):]
    return {
        "eta": eta,
        "steps": len(rows),
        "trained_tokens": sum(r["perf/trained_tokens"] for r in rows),
        "train_loop_s": step_time,
        "wall_s": wall,
        "tokens_per_s": sum(r["perf/trained_tokens"] for r in rows) / step_time,
        "step_s": step_time / len(rows),
        "wait_s": sum(r["perf/wait_batch_s"] for r in rows) / len(rows),
        "final_reward": sum(r["rollout/reward"] for r in tail) / len(tail),
        "max_staleness": max(r["rollout/staleness_max"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as root:
        results = [run_one(eta, root, args.overrides) for eta in (0, 4)]
    print("\n eta | steps | trained tok | loop s | tok/s  | step s | wait s | final reward | max stale")
    for r in results:
        print(f" {r['eta']:3d} | {r['steps']:5d} | {r['trained_tokens']:11.0f} | {r['train_loop_s']:6.1f} "
              f"| {r['tokens_per_s']:6.1f} | {r['step_s']:6.2f} | {r['wait_s']:6.2f} "
              f"| {r['final_reward']:12.3f} | {r['max_staleness']:9.0f}")
    sync, asyn = results
    print(f"\nthroughput ratio async/sync: {asyn['tokens_per_s'] / sync['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
