"""The summary printed at the end of `asyncrl train` / `asyncrl quickstart`."""

from asyncrl.cli import print_summary


def test_the_summary_shows_the_held_out_gain_and_each_health_warning(capsys):
    print_summary({"run_dir": "runs/x", "eval_before": 0.25, "eval_after": 0.625,
                   "health": ["steps 1-3: every sample got reward 0, ...",
                              "steps 2-4: 100% of the answers were cut, ..."]})
    out = capsys.readouterr().out.splitlines()
    assert "held-out reward after training : 0.6250  (+0.3750)" in out
    assert [line for line in out if line.startswith("WARNING")] == [
        "WARNING, the run cannot learn: steps 1-3: every sample got reward 0, ...",
        "WARNING, the run cannot learn: steps 2-4: 100% of the answers were cut, ..."]


def test_the_summary_shows_each_tasks_held_out_reward(capsys):
    print_summary({"run_dir": "runs/x", "eval_before": 0.5, "eval_after": 0.75,
                   "eval_before_by_task": {"a": 0.25, "b": 0.75},
                   "eval_after_by_task": {"a": 0.625, "b": 0.875}})
    out = capsys.readouterr().out.splitlines()
    i = out.index("held-out reward after training : 0.7500  (+0.2500)")
    assert out[i + 1:i + 3] == ["  a: 0.2500 -> 0.6250", "  b: 0.7500 -> 0.8750"]
