"""On a GPU machine: 2 FSDP trainer ranks + 1 vLLM server, weights by broadcast, a few steps.

    python benchmarks/gpu/dp_broadcast.py --model /path/to/Qwen2.5-0.5B-Instruct --steps 4

Runs async GRPO on reasoning-gym additions (generated offline) with
`allocation_mode=vllm:d1+fsdp:d2` and `actor.weight_update_mode=broadcast` on 3 GPUs
(ranks on GPUs 0-1, the server on GPU 2), then prints each step's time and its parts
(waiting for the batch, training, publishing) and the broadcast's gather / send times.
Add `--mode disk` to compare with weights through disk. Nothing is downloaded: `--model`
is a local HF folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from asyncrl.config import load_config
from asyncrl.observe import read_stats
from asyncrl.trainers.rl import train


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["broadcast", "disk"], default="broadcast")
    p.add_argument("--backend", choices=["vllm", "sglang", "local"], default="vllm")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="asyncrl-gpu-")
    cfg = load_config(None, [
        "experiment_name=gpu-dp-broadcast", f"trial_name={args.mode}",
        f"cluster.fileroot={root}", "cluster.n_gpus_per_node=3",
        f"allocation_mode={args.backend}:d1+fsdp:d2", f"actor.weight_update_mode={args.mode}",
        f"actor.path={args.model}", "actor.dtype=bfloat16", "local_engine.dtype=bfloat16",
        "gconfig.n_samples=4", "gconfig.max_new_tokens=256", "actor.optimizer.lr=1e-6",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=512",
        "train_dataset.batch_size=16", "rollout.max_head_offpolicyness=2",
        f"total_train_steps={args.steps}", "stats_logger.progress_bar=false",
        "evaluator.before_training=false", "evaluator.after_training=false", *args.overrides])
    summary = train(cfg)
    rows = [r for r in read_stats(f"{summary['run_dir']}/stats.jsonl") if r["kind"] == "train"]
    keys = ["perf/step_s", "perf/wait_batch_s", "perf/train_s", "perf/publish_s",
            "perf/weights_gather_s", "perf/weights_broadcast_s", "perf/weights_load_s",
            "perf/weights_save_s"]
    keys = [k for k in keys if any(k in r for r in rows)]
    print("step " + " ".join(f"{k.split('/')[1]:>20}" for k in keys))
    for r in rows:
        print(f"{r['step']:>4} " + " ".join(f"{r.get(k, float('nan')):>20.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
