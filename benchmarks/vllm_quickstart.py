"""The quickstart on the vLLM backend beside our local engine, seeded sampling on (the default).

    python benchmarks/vllm_quickstart.py                  # 6 steps each, seed 1
    python benchmarks/vllm_quickstart.py total_train_steps=10 seed=2

Each backend runs in a process of its own (`asyncrl quickstart rollout.backend=...`), one
after the other on the same machine. Prints, per backend: steps done, the run's wall time,
the median step, the held-out greedy reward before and after training, failed episodes and
server restarts, then the ratio vllm/local of wall time and median step. A backend that
fails prints its exit code and the last lines of its output instead of a row.
Any quickstart key can be overridden as key=value (for both runs).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.observe import read_stats

BACKENDS = ("local", "vllm")


def run_one(backend: str, fileroot: str, overrides: list[str]) -> dict[str, float] | str:
    """One quickstart run; its figures, or why it failed."""
    argv = [sys.executable, "-m", "asyncrl.cli", "quickstart", f"rollout.backend={backend}",
            "total_train_steps=6", "stats_logger.progress_bar=false", "stats_logger.plot=false",
            *overrides, f"cluster.fileroot={fileroot}", f"trial_name={backend}"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return f"exit code {proc.returncode}:\n{tail}"
    stats = read_stats(Path(fileroot) / "quickstart" / backend / "stats.jsonl")
    rows = [r for r in stats if r["kind"] == "train"]
    evals = {r["step"]: r["eval/reward"] for r in stats if r["kind"] == "eval"}
    return {"steps": len(rows), "wall_s": wall,
            "median_step_s": statistics.median(r["perf/step_s"] for r in rows),
            "eval_before": evals.get(0, float("nan")),
            "eval_after": evals.get(max(evals), float("nan")) if evals else float("nan"),
            "episodes_failed": sum(r.get("rollout/episodes_failed", 0) for r in rows),
            "server_restarts": rows[-1].get("inference/server_restarts", 0) if rows else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="quickstart keys, key=value")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-quickstart-") as root:
        for backend in BACKENDS:
            results[backend] = run_one(backend, root, args.overrides)
    print(f"{'backend':8} {'steps':>5} {'wall s':>7} {'median step s':>13} {'held-out':>14} "
          f"{'failed':>6} {'restarts':>8}")
    for backend, r in results.items():
        if isinstance(r, str):
            print(f"{backend:8} failed, {r}")
            continue
        print(f"{backend:8} {r['steps']:>5} {r['wall_s']:>7.1f} {r['median_step_s']:>13.2f} "
              f"{r['eval_before']:>6.3f} -> {r['eval_after']:.3f} "
              f"{r['episodes_failed']:>6.0f} {r['server_restarts']:>8.0f}")
    local, vllm = results["local"], results["vllm"]
    if not isinstance(local, str) and not isinstance(vllm, str):
        print(f"vllm/local: wall {vllm['wall_s'] / local['wall_s']:.2f}x, median step "
              f"{vllm['median_step_s'] / local['median_step_s']:.2f}x")


if __name__ == "__main__":
    main()
