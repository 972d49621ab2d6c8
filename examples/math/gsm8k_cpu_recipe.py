"""GSM8K on a 2-core CPU with SmolLM2-135M-Instruct: SFT, then GRPO from the SFT weights.

    python examples/math/gsm8k_cpu_recipe.py --gsm8k path/to/gsm8k [--seed 1] [--fileroot runs]

`--gsm8k` is a folder holding GSM8K's train.jsonl and test.jsonl. SmolLM2-135M-Instruct
solves ~2% of GSM8K greedily, too rarely for GRPO's groups to hold a correct answer, so
the recipe first fine-tunes it on GSM8K's worked solutions (`asyncrl sft` over
examples/sft/gsm8k_sft_cpu.yaml) and then runs GRPO (`asyncrl train` over
examples/math/gsm8k_grpo_cpu.yaml) with `actor.path` set to the folder the SFT run saved.
Each model is scored by `asyncrl eval` on fixed leading slices of GSM8K's test split:
greedy, and pass@k with k samples per item at the training temperature.

Phases, in order (`--phases` picks some; a later phase finds an earlier one's output in
the run folders): eval-base, sft, eval-sft, rl, eval-rl. Every command is printed before
it runs; `<fileroot>/gsm8k-cpu-recipe/seed<N>/recipe.json` records each phase's command,
wall time and scores. `--sft KEY=VALUE` and `--rl KEY=VALUE` (repeatable) override the
recipe's keys of one run. The sizing behind the defaults is in
examples/math/gsm8k_cpu_recipe.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SFT_YAML = HERE.parent / "sft" / "gsm8k_sft_cpu.yaml"
GRPO_YAML = HERE / "gsm8k_grpo_cpu.yaml"
ASYNCRL = [sys.executable, "-m", "asyncrl.cli"]  # the `asyncrl` command of this Python
PHASES = ("eval-base", "sft", "eval-sft", "rl", "eval-rl")
# The prompt of both runs' configs: the SFT run learns to answer it, GRPO and eval ask it.
SYSTEM_PROMPT = ("Solve the math problem step by step. End with the final answer on its own "
                 "line as: #### <number>")

# SFT: 180 steps of 16 rows (2,880 of GSM8K's 7,464 training solutions within max_length
# 512, 39% of an epoch), cosine decay from 5e-5: ~6.4 s a step on two cores, ~19 min.
SFT_KEYS = ["total_train_epochs=1", "total_train_steps=180", "train_dataset.batch_size=16",
            "model.optimizer.lr=5.0e-5", "evaluator.freq_steps=null"]
# GRPO: 40 steps of 8 prompts x 8 samples, answers up to 256 tokens (~30 s a step on two
# cores, ~20 min); the recipe scores the
# result with `asyncrl eval`, so the run's own greedy evaluations are off.
RL_KEYS = ["total_train_steps=40", "gconfig.n_samples=8", "train_dataset.batch_size=8",
           "actor.optimizer.lr=5.0e-6", "local_engine.max_batch_size=64",
           "evaluator.before_training=false", "evaluator.after_training=false"]


def run_dir(fileroot: Path, stage: str, seed: int) -> Path:
    """The folder of one of the recipe's training runs (RunPaths' layout)."""
    return fileroot / f"gsm8k-cpu-recipe-{stage}" / f"seed{seed}"


def saved_model(run: Path) -> Path:
    """The HF folder a finished run saved last: `checkpoints/step<N>` with the largest N."""
    steps = sorted((run / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))
    if not steps:
        raise SystemExit(f"{run}/checkpoints holds no step<N> folder: run its phase first "
                         "(--phases), or check its log for why it saved nothing")
    return steps[-1]


def sft_command(args: argparse.Namespace) -> list[str]:
    return [*ASYNCRL, "sft", "--config", str(SFT_YAML), *run_keys(args, "sft"),
            f"model.path={args.model}", f"train_dataset.path={args.gsm8k}",
            f"valid_dataset.path={args.gsm8k}", *SFT_KEYS, *args.sft]


def rl_command(args: argparse.Namespace, start: Path) -> list[str]:
    steps = next((kv.split("=", 1)[1] for kv in reversed([*RL_KEYS, *args.rl])
                  if kv.startswith("total_train_steps=")))
    return [*ASYNCRL, "train", "--config", str(GRPO_YAML), *run_keys(args, "rl"),
            f"actor.path={start}", f"train_dataset.path={args.gsm8k}",
            f"valid_dataset.path={args.gsm8k}", *RL_KEYS, f"saver.freq_steps={steps}", *args.rl]


def eval_commands(args: argparse.Namespace, model: Path | str, out: Path) -> list[list[str]]:
    """Greedy on the first `--limit` test items; pass@k on the first `--pass-limit`."""
    common = [*ASYNCRL, "eval", "--model", str(model), "--data", str(args.gsm8k),
              "--split", "test", "--reward", "gsm8k", "--system-prompt", SYSTEM_PROMPT,
              "--max-tokens", str(args.max_tokens), "--seed", str(args.seed), "--no-progress",
              *args.eval_arg]
    greedy = [*common, "--limit", str(args.limit), "--out", str(out / "greedy")]
    if args.pass_k <= 1:
        return [greedy]
    sampled = [*common, "--limit", str(args.pass_limit), "--k", f"1,{args.pass_k}",
               "--temperature", "1.0", "--out", str(out / f"pass{args.pass_k}")]
    return [greedy, sampled]


def run_keys(args: argparse.Namespace, stage: str) -> list[str]:
    return [f"experiment_name=gsm8k-cpu-recipe-{stage}", f"trial_name=seed{args.seed}",
            f"cluster.fileroot={args.fileroot}", f"seed={args.seed}",
            "stats_logger.progress_bar=false"]


def timed(cmd: list[str]) -> float:
    """Run `cmd` (printed first), fail with its exit status; its wall time in seconds."""
    print("+ " + shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise SystemExit(f"exit status {rc}: {shlex.join(cmd)}")
    return time.monotonic() - t0


def evaluate(args: argparse.Namespace, model: Path | str, out: Path) -> dict[str, Any]:
    """Each evaluation's wall time and its `eval/...` scores from summary.json."""
    record: dict[str, Any] = {"model": str(model), "commands": [], "wall_s": 0.0}
    for cmd in eval_commands(args, model, out):
        record["wall_s"] += timed(cmd)
        record["commands"].append(shlex.join(cmd))
        folder = Path(cmd[cmd.index("--out") + 1])
        stats = json.loads((folder / "summary.json").read_text())["stats"]
        record[folder.name] = {k.removeprefix("eval/"): v for k, v in stats.items()}
    return record


def rl_signal(run: Path) -> dict[str, float]:
    """From batches.jsonl and stats.jsonl: how much GRPO had to learn from.

    A group whose samples all got the same reward has zero advantage everywhere, so the
    share of groups with mixed rewards is the share of prompts that moved the policy.
    """
    steps = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    groups: dict[str, list[float]] = {}
    for step in steps:
        for gid, reward in zip(step["group_ids"], step["rewards"]):
            groups.setdefault(gid, []).append(reward)
    train = [r for r in map(json.loads, (run / "stats.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    tenth = max(1, len(train) // 10)
    return {
        "groups": len(groups),
        "mixed_group_share": sum(len(set(g)) > 1 for g in groups.values()) / len(groups),
        "reward_first_tenth": mean(r["rollout/reward"] for r in train[:tenth]),
        "reward_last_tenth": mean(r["rollout/reward"] for r in train[-tenth:]),
        "truncated_share": mean(r["rollout/frac_truncated"] for r in train),
        "output_tokens_mean": mean(r["rollout/output_tokens_mean"] for r in train),
        "step_s_mean": mean(r["perf/step_s"] for r in train),
    }


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gsm8k", required=True, type=Path,
                        help="folder holding GSM8K's train.jsonl and test.jsonl")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fileroot", type=Path, default=Path("runs"))
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated, from {','.join(PHASES)}")
    parser.add_argument("--limit", type=int, default=256, help="greedy: first N test items")
    parser.add_argument("--pass-limit", type=int, default=64,
                        help="pass@k: first N test items")
    parser.add_argument("--pass-k", type=int, default=8, help="samples per item (1: none)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per evaluated answer")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--eval-arg", action="append", default=[], metavar="ARG",
                        help="passed to every asyncrl eval, e.g. --eval-arg=--dtype=float32")
    args = parser.parse_args(argv)
    args.phases = args.phases.split(",")
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"--phases: {unknown} are not among {list(PHASES)}")
    if not (args.gsm8k / "train.jsonl").is_file() or not (args.gsm8k / "test.jsonl").is_file():
        parser.error(f"--gsm8k {args.gsm8k}: needs train.jsonl and test.jsonl in it")
    args.gsm8k, args.fileroot = args.gsm8k.resolve(), args.fileroot.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.fileroot / "gsm8k-cpu-recipe" / f"seed{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "recipe.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    sft_run, rl_run = run_dir(args.fileroot, "sft", args.seed), run_dir(args.fileroot, "rl",
                                                                          args.seed)
    for phase in args.phases:
        if phase == "eval-base":
            record[phase] = evaluate(args, args.model, out / "eval-base")
        elif phase == "sft":
            cmd = sft_command(args)
            record[phase] = {"command": shlex.join(cmd), "wall_s": timed(cmd),
                             "model_dir": str(saved_model(sft_run))}
        elif phase == "eval-sft":
            record[phase] = evaluate(args, saved_model(sft_run), out / "eval-sft")
        elif phase == "rl":
            cmd = rl_command(args, saved_model(sft_run))
            record[phase] = {"command": shlex.join(cmd), "wall_s": timed(cmd),
                             "model_dir": str(saved_model(rl_run)), **rl_signal(rl_run)}
        elif phase == "eval-rl":
            record[phase] = evaluate(args, saved_model(rl_run), out / "eval-rl")
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"== {phase}: {record[phase]['wall_s']:.0f} s; record in {record_path}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
