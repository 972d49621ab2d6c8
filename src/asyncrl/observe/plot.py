"""The reward curve of a run, from its stats.jsonl."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from asyncrl.observe.stats import by_task, read_stats

# each task's held-out curve; blue and red are the training and whole-set curves'
TASK_COLOURS = ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                "tab:cyan", "tab:gray")


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def reward_curve_series(rows: list[dict[str, Any]], *, window: int = 5
                        ) -> dict[str, tuple[list[int], list[float]]]:
    """The reward curve's series, (steps, rewards) each, from stats.jsonl rows: "train"
    (the batch's reward per step), "train_mean" (its `window`-step running mean) and
    "held_out" (greedy reward at each evaluation, at the step of the weights it read), and
    "held_out:<task>" for each task of a held-out set that mixes tasks."""
    train = [r for r in rows if r["kind"] == "train" and r.get("rollout/reward") is not None]
    evals = [r for r in rows if r["kind"] == "eval" and r.get("eval/reward") is not None]
    steps = [r["step"] for r in train]
    rewards = [r["rollout/reward"] for r in train]
    series = {"train": (steps, rewards), "train_mean": (steps, _smooth(rewards, window)),
              "held_out": ([r["step"] for r in evals], [r["eval/reward"] for r in evals])}
    for r in evals:  # a mixed held-out set: each task's reward too
        for task, task_stats in by_task(r).items():
            task_steps, task_rewards = series.setdefault(f"held_out:{task}", ([], []))
            task_steps.append(r["step"])
            task_rewards.append(task_stats["reward"])
    return series


def plot_reward_curve(stats_path: Path, out_path: Path, *, title: str = "") -> Path:
    """Training reward per step (raw and smoothed) and held-out reward at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = reward_curve_series(read_stats(stats_path))
    fig, ax = plt.subplots(figsize=(7, 4))
    if series["train"][0]:
        ax.plot(*series["train"], color="tab:blue", alpha=0.3, label="train reward")
        ax.plot(*series["train_mean"], color="tab:blue", label="train reward (5-step mean)")
    if series["held_out"][0]:
        ax.plot(*series["held_out"], "o-", color="tab:red", label="held-out reward (greedy)")
    tasks = [name for name in series if name.startswith("held_out:")]
    for name, colour in zip(tasks, itertools.cycle(TASK_COLOURS)):
        ax.plot(*series[name], "s--", color=colour, label=f"held-out: {name[len('held_out:'):]}")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
