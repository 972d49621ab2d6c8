"""Soak: the quickstart recipe under faults on a schedule, against the same run without them.

    python benchmarks/soak.py --minutes 30                # SmolLM2, the quickstart's recipe
    python benchmarks/soak.py --minutes 2 --tiny          # a tiny random model (a smoke run)

The faulted run is `asyncrl quickstart` with a recover checkpoint after every step, cut
into segments of --segment steps:
- the trainer kills itself (SIGKILL) at a fault point of the segment's last step:
  generate, train, publish and checkpoint in turn (`ASYNCRL_FAULT`, api/faults.py); the
  driver starts it again with recover.mode=auto;
- the inference server is SIGKILLed halfway through each segment (the trainer restarts it);
- the reward hangs on the first run of one item in --hang-every (it times out after
  --reward-timeout seconds and the episode is run again, rollout.episode_retries).
At --minutes the driver SIGKILLs the trainer wherever it is, then resumes it once more with
total_train_steps at its checkpoint's step, which only runs the final evaluation. The same
recipe then runs without faults for as many steps.

Printed: faults injected and recovered per kind; the items accounted for at the end
(drawn from the data stream = trained + in flight or queued + failed for good + lost; lost
is computed, and 0 when nothing was lost); items trained twice; the training reward in
blocks of steps and the held-out reward of both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from asyncrl.api.faults import POINTS
from asyncrl.controller import recover

HERE = Path(__file__).resolve().parent


def overrides(args: argparse.Namespace, trial: str, steps: int) -> list[str]:
    out = [f"cluster.fileroot={args.out / 'runs'}", "experiment_name=soak", f"trial_name={trial}",
           f"total_train_steps={steps}", "total_train_epochs=1",
           f"train_dataset.size={args.dataset_size}", "recover.mode=auto",
           "recover.freq_steps=1", "recover.freq_secs=null", "stats_logger.progress_bar=false",
           "workflow.reward_fn=soak_rewards:hang_once",
           f"workflow.reward_timeout={args.reward_timeout}", "rollout.episode_retries=1"]
    if args.tiny:
        from asyncrl.models.tiny import make_tiny_model

        if not (args.out / "tiny").exists():
            make_tiny_model(args.out / "tiny", arch="llama")
        out += [f"actor.path={args.out / 'tiny'}", "valid_dataset.size=16"]
    return out + args.override


def launch(args: argparse.Namespace, trial: str, steps: int, fault: str | None,
           log: Path) -> subprocess.Popen:
    env = dict(os.environ, SOAK_HANG_EVERY=str(args.hang_every if trial == "faults" else 0),
               SOAK_MARKS=str(args.out / "marks"),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("ASYNCRL_FAULT", None)
    if fault:
        env["ASYNCRL_FAULT"] = fault
    cmd = [sys.executable, "-m", "asyncrl.cli", "quickstart",
           *overrides(args, trial, steps)]
    with open(log, "a") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line torn by a kill (the resumed run drops it)
    return rows


def last_step(run: Path) -> int:
    steps = [r["step"] for r in jsonl(run / "stats.jsonl") if r.get("kind") == "train"]
    return max(steps, default=0)


def kill_server(run: Path) -> bool:
    try:
        workers = json.loads((run / "services.json").read_text())["workers"]
        pid = next(w["pid"] for w in workers if w["role"] == "inference")
        os.killpg(pid, signal.SIGKILL)
        return True
    except (OSError, ValueError, KeyError, StopIteration):
        return False


def faulted_run(args: argparse.Namespace) -> dict:
    run = args.out / "runs" / "soak" / "faults"
    log = args.out / "faults.log"
    (args.out / "marks").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.minutes
    injected: Counter = Counter()
    step, segment = 0, 0
    while True:
        point = POINTS[segment % len(POINTS)]
        fault_step = step + args.segment
        proc = launch(args, "faults", 10**6, f"{point}@{fault_step}", log)
        server_killed, stopped = False, False
        while proc.poll() is None:
            time.sleep(0.5)
            now = last_step(run)
            if not server_killed and now >= step + args.segment // 2 and kill_server(run):
                injected["server killed"] += 1
                server_killed = True
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGKILL)
                stopped = True
        proc.wait()
        if proc.returncode != -signal.SIGKILL:
            raise SystemExit(f"the faulted run ended with {proc.returncode}; see {log}")
        injected["trainer killed at " + ("the deadline" if stopped else point)] += 1
        step = recover.checkpoint_step(run / "recover") or 0
        segment += 1
        if stopped:
            break
    final = launch(args, "faults", step, None, log)  # resume: only the final evaluation
    if final.wait() != 0:
        raise SystemExit(f"the final resume failed; see {log}")
    return {"run": run, "steps": step, "injected": injected}


def clean_run(args: argparse.Namespace, steps: int) -> Path:
    run = args.out / "runs" / "soak" / "clean"
    proc = launch(args, "clean", steps, None, args.out / "clean.log")
    if proc.wait() != 0:
        raise SystemExit(f"the fault-free run failed; see {args.out / 'clean.log'}")
    return run


def accounting(run: Path) -> dict[str, int]:
    """Every item drawn from the data stream is trained, queued (in flight at the last
    checkpoint, run again on resume), finished but not yet trained, failed for good, or
    lost. Only one epoch is run, so an item trained twice is a duplicate."""
    with open(run / "recover" / "rollout.pkl", "rb") as f:
        state = pickle.load(f)
    stream = state["stream"]
    if stream["epoch"]:
        raise SystemExit("the soak ran past one epoch; raise --dataset-size")
    batches = jsonl(run / "batches.jsonl")
    trained = [tid for b in batches for tid in dict.fromkeys(b["task_ids"])]
    counts = state["counts"]
    drawn = stream["position"]
    queued, finished = len(state["pending"]), len(state["buffer"])
    failed = counts["episodes_failed"] + counts["episodes_rejected"] \
        + counts["groups_dropped_total"]
    return {"drawn": drawn, "trained": len(trained), "queued": queued,
            "finished, not yet trained": finished, "failed for good": failed,
            "lost": drawn - len(trained) - queued - finished - failed,
            "trained twice": len(trained) - len(set(trained))}


def recovered(run: Path, log: Path) -> dict[str, int]:
    log = log.read_text()  # every launch's output
    reports = jsonl(run / "failures.jsonl")
    trained = {tid for b in jsonl(run / "batches.jsonl") for tid in b["task_ids"]}
    hung = [r for r in reports if "RewardTimeout" in r["error"]]
    return {"trainer resumed": log.count("resumed from"),
            "server restarted": log.count("restarting it"),
            "hung rewards timed out": len(hung),
            "  of whose items trained later": sum(r["item_id"] in trained for r in hung)}


def curve(run: Path, block: int) -> tuple[list[float], dict[int, float]]:
    rows = {r["step"]: r for r in jsonl(run / "stats.jsonl") if r.get("kind") == "train"}
    rewards = [rows[s]["rollout/reward"] for s in sorted(rows)]
    means = [sum(rewards[i:i + block]) / len(rewards[i:i + block])
             for i in range(0, len(rewards), block)]
    evals = {r["step"]: r["eval/reward"] for r in jsonl(run / "stats.jsonl")
             if r.get("kind") == "eval"}
    return means, evals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--segment", type=int, default=12, help="steps per trainer kill")
    parser.add_argument("--hang-every", type=int, default=25)
    parser.add_argument("--reward-timeout", type=float, default=5.0)
    parser.add_argument("--dataset-size", type=int, default=4000, help="one epoch, never done")
    parser.add_argument("--block", type=int, default=25, help="steps per reward-curve block")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("override", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args()
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="soak-"))).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.minutes:g} min of faults, then a fault-free run; output in {args.out}",
          flush=True)

    t0 = time.monotonic()
    faulted = faulted_run(args)
    t1 = time.monotonic()
    clean = clean_run(args, faulted["steps"])
    t2 = time.monotonic()

    print(f"\nsteps: {faulted['steps']} in each run; wall time {t1 - t0:.0f} s with faults, "
          f"{t2 - t1:.0f} s without")
    print("\nfaults injected")
    for kind, n in sorted(faulted["injected"].items()):
        print(f"  {kind:32s} {n}")
    print(f"  {'reward hangs (first runs)':32s} {len(list((args.out / 'marks').iterdir()))}")
    print("recovered")
    for kind, n in recovered(faulted["run"], args.out / "faults.log").items():
        print(f"  {kind:32s} {n}")
    print("items (faulted run, at its last checkpoint)")
    for kind, n in accounting(faulted["run"]).items():
        print(f"  {kind:32s} {n}")
    print(f"\ntraining reward, mean per {args.block} steps (faulted | fault-free)")
    (faulted_curve, faulted_eval), (clean_curve, clean_eval) = (
        curve(faulted["run"], args.block), curve(clean, args.block))
    for i, (a, b) in enumerate(zip(faulted_curve, clean_curve)):
        print(f"  steps {i * args.block + 1:4d}-{(i + 1) * args.block:<4d} {a:6.3f} | {b:6.3f}")
    print("held-out reward (faulted | fault-free)")
    for step in sorted(set(faulted_eval) | set(clean_eval)):
        print(f"  step {step:4d} {faulted_eval.get(step, float('nan')):6.3f} | "
              f"{clean_eval.get(step, float('nan')):6.3f}")


if __name__ == "__main__":
    main()
