"""Each trainer moves its own signal on SmolLM2-135M-Instruct, on this CPU machine.

    python benchmarks/algorithms.py sft --gsm8k ../shared/data/gsm8k   # held-out loss falls
    python benchmarks/algorithms.py dpo                                 # held-out margin rises
    python benchmarks/algorithms.py ppo                                 # quickstart reward rises
    python benchmarks/algorithms.py dapo                                # quickstart reward rises
    python benchmarks/algorithms.py ppo total_train_steps=10            # any config key=value

sft: GSM8K worked solutions (the loss reads the solution tokens), held-out loss on GSM8K
test questions before and after. dpo: two-term additions from reasoning-gym (the
quickstart's task), chosen = the right sum, rejected = a sum off by 1 to 10, both in the
quickstart's answer format; held-out DPO margin and accuracy before and after. ppo / dapo:
the quickstart (async RL on two-digit addition) with a critic / with DAPO's settings;
held-out greedy reward before and after, and the mean training reward of the first and
last steps. Each prints one table row per figure.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.config.offline import DPOConfig, SFTConfig
from asyncrl.observe import read_stats

REPO = Path(__file__).resolve().parents[1]

# What each RL algorithm changes in the quickstart recipe.
RL_SETTINGS = {
    "ppo": ["critic.path=${actor.path}", "critic.optimizer.lr=1.0e-5",
            "actor.reward_norm.std_level=none", "experiment_name=bench-ppo"],
    "dapo": ["rollout.dynamic_sampling=true", "actor.eps_clip_higher=0.28",
             "actor.loss_agg_mode=token-mean", "actor.overlong_reward_penalty=true",
             "actor.overlong_tokens=8", "experiment_name=bench-dapo"],
}

# Each algorithm's own part, shown at its first and last step.
ALGORITHM_STATS = {
    "ppo": ["critic/loss", "critic/explained_var", "critic/values_mean"],
    "dapo": ["rollout/groups_dropped", "rollout/groups_dropped_total"],
}


def run_sft(root: str, gsm8k: str, overrides: list[str]) -> dict[str, Any]:
    from asyncrl.offline.sft import train

    cfg = load_config(REPO / "examples/sft/gsm8k_sft_cpu.yaml", [
        f"cluster.fileroot={root}", f"train_dataset.path={gsm8k}", f"valid_dataset.path={gsm8k}",
        "total_train_steps=40", "evaluator.freq_steps=null", "stats_logger.progress_bar=false",
        *overrides], schema=SFTConfig)
    summary = train(cfg)
    return {"held-out loss": (summary["eval_before"]["loss"], summary["eval_after"]["loss"])}


def arithmetic_pairs(path: Path, *, n: int, seed: int) -> Path:
    """`n` preference rows: the right sum (chosen) against one off by 1..10 (rejected)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            wrong = a + b + rng.choice([-1, 1]) * rng.randint(1, 10)
            answer = "{a} + {b} = {c}. <answer>{c}</answer>"
            f.write(json.dumps({
                "prompt": f"Calculate {a} + {b}. Give the final answer inside <answer></answer> "
                          "tags.",
                "chosen": answer.format(a=a, b=b, c=a + b),
                "rejected": answer.format(a=a, b=b, c=wrong)}) + "\n")
    return path


def run_dpo(root: str, overrides: list[str]) -> dict[str, Any]:
    from asyncrl.offline.dpo import train

    data = Path(root) / "prefs"
    data.mkdir()
    cfg = load_config(REPO / "examples/dpo/preference_dpo_cpu.yaml", [
        f"cluster.fileroot={root}",
        f"train_dataset.path={arithmetic_pairs(data / 'train.jsonl', n=320, seed=0)}",
        f"valid_dataset.path={arithmetic_pairs(data / 'valid.jsonl', n=64, seed=1)}",
        "total_train_steps=40", "model.optimizer.lr=5.0e-6", "evaluator.freq_steps=null",
        "stats_logger.progress_bar=false", *overrides], schema=DPOConfig)
    summary = train(cfg)
    before, after = summary["eval_before"], summary["eval_after"]
    return {f"held-out {key}": (before[key], after[key])
            for key in ("loss", "reward_margin", "reward_accuracy")}


def run_rl(algo: str, root: str, overrides: list[str]) -> dict[str, Any]:
    from asyncrl.controller.rl import train

    recipe = resources.files("asyncrl.recipes") / "quickstart.yaml"
    with resources.as_file(recipe) as path:
        cfg = load_config(path, [*RL_SETTINGS[algo], f"cluster.fileroot={root}",
                                 "stats_logger.progress_bar=false", "stats_logger.plot=false",
                                 *overrides])
    summary = train(cfg)
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl")
            if r["kind"] == "train"]
    k = max(1, len(rows) // 4)
    first = sum(r["rollout/reward"] for r in rows[:k]) / k
    last = sum(r["rollout/reward"] for r in rows[-k:]) / k
    out = {"held-out greedy reward": (summary["eval_before"], summary["eval_after"]),
           f"training reward, first/last {k} steps": (first, last)}
    for key in ALGORITHM_STATS[algo]:
        out[f"{key} (step 1 / last)"] = (rows[0][key], rows[-1][key])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algo", choices=["sft", "dpo", *RL_SETTINGS])
    parser.add_argument("--gsm8k", default=str(REPO.parent / "shared/data/gsm8k"),
                        help="folder with GSM8K's train.jsonl / test.jsonl (sft)")
    parser.add_argument("overrides", nargs="*", help="key=value")
    args = parser.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as root:
        if args.algo == "sft":
            result = run_sft(root, args.gsm8k, args.overrides)
        elif args.algo == "dpo":
            result = run_dpo(root, args.overrides)
        else:
            result = run_rl(args.algo, root, args.overrides)
    print(f"\n{args.algo} on SmolLM2-135M-Instruct ({time.monotonic() - t0:.0f} s)")
    print(f"{'figure':44s} | {'before':>9s} | {'after':>9s}")
    for key, (before, after) in result.items():
        print(f"{key:44s} | {before:9.4g} | {after:9.4g}")


if __name__ == "__main__":
    main()
