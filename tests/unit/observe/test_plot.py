"""The reward curve's data: training reward per step and the held-out points."""

import json

import pytest

from asyncrl.observe.plot import plot_reward_curve, reward_curve_series


def _rows():
    rows = [{"step": 0, "kind": "eval", "eval/reward": 0.25}]
    for step, reward in [(1, 0.2), (2, 0.4), (3, 0.6)]:
        rows.append({"step": step, "kind": "train", "rollout/reward": reward})
        if step == 2:
            rows.append({"step": 2, "kind": "eval", "eval/reward": 0.5})
    rows.append({"step": 3, "kind": "eval", "eval/reward": 0.625})
    return rows


def test_the_curve_has_the_held_out_points_at_their_steps():
    series = reward_curve_series(_rows(), window=2)
    assert series["held_out"] == ([0, 2, 3], [0.25, 0.5, 0.625])
    assert series["train"] == ([1, 2, 3], [0.2, 0.4, 0.6])
    steps, mean = series["train_mean"]
    assert steps == [1, 2, 3] and mean == pytest.approx([0.2, 0.3, 0.5])  # 2-step means


def test_a_mixed_held_out_set_has_a_series_per_task():
    rows = [{"step": 0, "kind": "eval", "eval/reward": 0.5, "eval/task/a/reward": 0.75,
             "eval/task/a/n": 4.0, "eval/task/b/reward": 0.25, "eval/task/b/n": 4.0},
            {"step": 5, "kind": "eval", "eval/reward": 0.625, "eval/task/a/reward": 1.0,
             "eval/task/a/n": 4.0, "eval/task/b/reward": 0.25, "eval/task/b/n": 4.0}]
    series = reward_curve_series(rows)
    assert series["held_out"] == ([0, 5], [0.5, 0.625])
    assert series["held_out:a"] == ([0, 5], [0.75, 1.0])
    assert series["held_out:b"] == ([0, 5], [0.25, 0.25])
    assert sorted(series) == ["held_out", "held_out:a", "held_out:b", "train", "train_mean"]


def test_plot_reward_curve_reads_stats_jsonl(tmp_path):
    stats = tmp_path / "stats.jsonl"
    stats.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    png = plot_reward_curve(stats, tmp_path / "reward_curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
