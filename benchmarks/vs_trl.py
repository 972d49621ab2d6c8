"""asyncrl against TRL's GRPOTrainer on the quickstart, one after the other, same machine.

    python benchmarks/vs_trl.py                       # 25 steps each (~30 min on 2 cores)
    python benchmarks/vs_trl.py --steps 10 --out runs/vs_trl

Both train SmolLM2-135M-Instruct on the quickstart's task (two-digit addition from
reasoning-gym) with the same prompt (system prompt + one worked example, the model's chat
template), the same reward (`asyncrl.rewards.rgym`, imported by file in TRL's process),
batch (8 prompts x 4 samples), learning rate (1e-5, constant), clip (0.2), no KL, no
warm-up, temperature 1 and 32 new tokens. TRL runs as it does on a CPU: HF `generate`
inside the trainer, bf16 autocast, without gradient checkpointing (memory is not short
here), in its own virtual environment (made by this script with torch==2.13.0 first, then
trl and reasoning-gym). asyncrl runs its quickstart command.

Printed: the wall time (from each command's start, model loading included) at which the
5-step mean of the training reward first reaches each level, the ratio, the held-out
greedy reward of the base model and of each trained model by one evaluator (asyncrl's
engine and workflow, 128 held-out items), and the peak memory of each run's processes
together (PSS summed over the process tree, sampled every 0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LEVELS = (0.3, 0.4, 0.5, 0.6)

TRL_SCRIPT = r'''
import importlib.util, json, sys, time
START = time.time()
cfg = json.load(open(sys.argv[1]))
import dataclasses
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

spec = importlib.util.spec_from_file_location("rgym", cfg["reward_file"])
rgym = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rgym)
rows = [json.loads(line) for line in open(cfg["items"])]
data = Dataset.from_list([{"prompt": r["messages"], "item_json": json.dumps(r["item"])}
                          for r in rows])

def reward(completions, item_json, **_):
    return [rgym.reasoning_gym_reward(c[0]["content"], json.loads(i))
            for c, i in zip(completions, item_json)]

class Log(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **_):
        if logs and "reward" in logs:
            with open(cfg["log"], "a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.time() - START,
                                    "reward": float(logs["reward"])}) + "\n")

wanted = dict(output_dir=cfg["out"], per_device_train_batch_size=cfg["prompts"] * cfg["samples"],
              num_generations=cfg["samples"], max_completion_length=cfg["max_new_tokens"],
              learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_ratio=0.0,
              weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, temperature=1.0,
              num_iterations=1, max_steps=cfg["steps"], logging_steps=1, save_strategy="no",
              report_to=[], use_cpu=True, bf16=True, seed=cfg["seed"], log_completions=False,
              gradient_checkpointing=False)
names = {f.name for f in dataclasses.fields(GRPOConfig)}
dropped = sorted(set(wanted) - names)
if dropped:
    print("GRPOConfig of this TRL lacks", dropped, flush=True)
args = GRPOConfig(**{k: v for k, v in wanted.items() if k in names})
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=reward, args=args, train_dataset=data,
                      callbacks=[Log()])
trainer.train()
trainer.save_model(cfg["out"] + "/final")
'''


def tree_rss(root: int) -> int:
    """Bytes of memory of `root` and all its descendants: their proportional set sizes (PSS),
    so pages they share (libraries, shared memory) count once, not once per process."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_measured(argv: list[str], log: Path,
                 env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run `argv` to the end (output to `log`); (start time, seconds, peak bytes of its
    process tree)."""
    peak = 0
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.5):
                peak = max(peak, tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        done.set()
        sampler.join()
    if code:
        raise SystemExit(f"{argv[0]} ... failed with exit code {code}; see {log}")
    return start, time.time() - start, peak


def ensure_trl_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel, first
        subprocess.run([*pip, "trl==1.16.*", "reasoning-gym", "datasets"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision",
                        "torchaudio"], check=False)
    return python


def time_to_levels(rows: list[tuple[int, float, float]]) -> dict[float, float | None]:
    """For each level: the first time the 5-step mean training reward reaches it."""
    out: dict[float, float | None] = dict.fromkeys(LEVELS)
    window: list[float] = []
    for _, t, reward in rows:
        window = [*window[-4:], reward]
        mean = sum(window) / len(window)
        for level in LEVELS:
            if out[level] is None and len(window) == 5 and mean >= level:
                out[level] = t
    return out


def quickstart_config(overrides: list[str]) -> Any:
    from asyncrl.config.loader import load_config

    return load_config(resources.files("asyncrl.recipes") / "quickstart.yaml", overrides)


def evaluate_model(path: str, cfg: Any, tokenizer_path: str) -> float:
    """Held-out greedy reward of the weights at `path`, by the quickstart's evaluator, with
    the base model's tokenizer and chat template whoever saved the weights."""
    from transformers import AutoTokenizer

    from asyncrl.controller.rollout.evaluate import evaluate
    from asyncrl.controller.workflows.rlvr import RLVRWorkflow
    from asyncrl.data.loading import held_out, load_dataset
    from asyncrl.inference.server.engine import LocalEngine
    from asyncrl.inference.server.local_backend import LocalBackend

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    workflow = RLVRWorkflow.from_config(tokenizer, cfg.gconfig, cfg.workflow).for_eval(
        cfg.evaluator.max_new_tokens)
    items = held_out(load_dataset(cfg.valid_dataset), load_dataset(cfg.train_dataset))
    engine = LocalEngine.spawn(path, cfg.local_engine, seed=cfg.seed)
    try:
        stats, _ = asyncio.run(evaluate(LocalBackend(engine), workflow, items,
                                        concurrency=cfg.local_engine.max_batch_size))
    finally:
        engine.close()
    return stats["eval/reward"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--out", default="runs/vs_trl")
    parser.add_argument("--trl-venv", default=".trl-venv")
    parser.add_argument("--skip-trl", action="store_true", help="asyncrl only (no TRL run)")
    args = parser.parse_args()

    import torch

    from asyncrl.data.loading import load_dataset
    from asyncrl.data.prompts import build_messages
    from asyncrl.models.hub import resolve_model_path

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = quickstart_config([f"total_train_steps={args.steps}"])
    model = resolve_model_path(cfg.actor.path)
    results: dict[str, dict[str, Any]] = {}

    if not args.skip_trl:
        python = ensure_trl_venv(Path(args.trl_venv).resolve())
        items = load_dataset(cfg.train_dataset)
        with open(out / "trl_items.jsonl", "w") as f:
            for item in items:
                messages = build_messages(item["question"], system_prompt=cfg.workflow.system_prompt,
                                          few_shot=cfg.workflow.few_shot)
                f.write(json.dumps({"messages": messages, "item": item}) + "\n")
        log = out / "trl_rewards.jsonl"
        log.unlink(missing_ok=True)
        trl_cfg = {"model": model, "items": str(out / "trl_items.jsonl"), "log": str(log),
                   "out": str(out / "trl"), "steps": args.steps, "lr": cfg.actor.optimizer.lr,
                   "prompts": cfg.train_dataset.batch_size, "samples": cfg.gconfig.n_samples,
                   "max_new_tokens": cfg.gconfig.max_new_tokens, "seed": cfg.seed,
                   "reward_file": str(REPO / "src" / "asyncrl" / "rewards" / "rgym.py")}
        (out / "trl_config.json").write_text(json.dumps(trl_cfg))
        (out / "trl_run.py").write_text(TRL_SCRIPT)
        _, seconds, peak = run_measured([str(python), str(out / "trl_run.py"),
                                      str(out / "trl_config.json")], out / "trl.log",
                                     env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
        rows = [(r["step"], r["time"], r["reward"]) for r in map(json.loads, log.open())]
        results["TRL GRPOTrainer"] = {"seconds": seconds, "peak": peak, "rows": rows,
                                      "model": str(out / "trl" / "final")}

    run_root = out / "asyncrl"
    t0, seconds, peak = run_measured(
        [sys.executable, "-m", "asyncrl.cli", "quickstart", f"total_train_steps={args.steps}",
         f"cluster.fileroot={run_root}", "stats_logger.progress_bar=false",
         "evaluator.before_training=false", "evaluator.after_training=false",
         f"saver.freq_steps={args.steps}"], out / "asyncrl.log")
    run_dir = run_root / cfg.experiment_name / cfg.trial_name
    stats = [json.loads(line) for line in (run_dir / "stats.jsonl").open()]
    rows = [(s["step"], s["time"] - t0, s["rollout/reward"]) for s in stats
            if s.get("kind") == "train"]
    results["asyncrl"] = {"seconds": seconds, "peak": peak, "rows": rows,
                          "model": str(run_dir / "checkpoints" / f"step{args.steps}")}

    torch.set_num_threads(os.cpu_count() or 1)
    base = evaluate_model(model, cfg, model)
    for r in results.values():
        r["held_out"] = evaluate_model(r["model"], cfg, model)
        r["levels"] = time_to_levels(r["rows"])

    print(f"\nquickstart task, SmolLM2-135M-Instruct, {args.steps} steps of 8 prompts x 4 samples, "
          f"{os.cpu_count()} cores")
    header = f"{'':18s} {'total s':>8s} {'s/step':>7s} " + " ".join(
        f"{'r>=' + str(level):>8s}" for level in LEVELS) + f" {'held-out':>9s} {'peak GiB':>8s}"
    print(header)
    for name, r in results.items():
        levels = " ".join(f"{r['levels'][lv]:8.0f}" if r["levels"][lv] is not None
                          else f"{'-':>8s}" for lv in LEVELS)
        print(f"{name:18s} {r['seconds']:8.0f} {r['seconds'] / args.steps:7.1f} {levels} "
              f"{r['held_out']:9.3f} {r['peak'] / 2**30:8.2f}")
    print(f"held-out greedy reward of the base model: {base:.3f}")
    if len(results) == 2:
        trl, ours = results["TRL GRPOTrainer"], results["asyncrl"]
        for level in LEVELS:
            a, b = ours["levels"][level], trl["levels"][level]
            if a is not None and b is not None:
                print(f"time to training reward >= {level}: TRL / asyncrl = {b / a:.2f}x")
        print(f"whole run: TRL / asyncrl = {trl['seconds'] / ours['seconds']:.2f}x")


if __name__ == "__main__":
    main()
