"""The run-health checks: which warning, at which step, over which steps."""

import logging

import pytest

from asyncrl.api import Trajectory
from asyncrl.controller.health import HealthMonitor, StepSignals, step_signals

SAMPLE = {"prompt": "Calculate 12 + 30.", "completion": "42", "reward": 0.0}


def _signals(step, groups, truncated=0.0, reward_failures=0, failure=""):
    return StepSignals(step=step, group_rewards=groups, truncated_frac=truncated,
                       episodes=len(groups), reward_failures=reward_failures, failure=failure,
                       sample=SAMPLE)


LEARNING = [[0.0, 1.0], [1.0, 1.0]]  # one group with signal
FLAT = [[0.0, 0.0], [1.0, 1.0]]  # groups flat, batch not constant
ZERO = [[0.0, 0.0], [0.0, 0.0]]  # the whole batch 0


def _run(monitor, steps):
    """{step: [conditions that warned at it]} over `steps` (a list of StepSignals)."""
    return {s.step: [f.condition for f in monitor.observe(s)] for s in steps}


def test_flat_groups_warn_at_the_third_consecutive_step_once():
    monitor = HealthMonitor(3, max_new_tokens=32)
    groups = [LEARNING, FLAT, FLAT, LEARNING, FLAT, FLAT, FLAT, FLAT, FLAT]
    warned = _run(monitor, [_signals(i + 1, g) for i, g in enumerate(groups)])
    # steps 2-3 are a streak of 2 (broken at 4); steps 5, 6, 7 reach 3 at step 7
    assert warned == {1: [], 2: [], 3: [], 4: [], 5: [], 6: [], 7: ["flat_groups"], 8: [], 9: []}
    [finding] = monitor.findings
    assert (finding.first_step, finding.last_step) == (5, 9)  # the streak went on to the end
    assert "rollout.dynamic_sampling" in finding.message and "gconfig.n_samples" in finding.message
    assert str(finding).startswith("steps 5-9: ")


def test_a_constant_batch_warns_with_a_sample_and_not_as_flat_groups(caplog):
    monitor = HealthMonitor(2, max_new_tokens=32)
    with caplog.at_level(logging.WARNING, logger="asyncrl.controller.health"):
        warned = _run(monitor, [_signals(s, ZERO) for s in (4, 5, 6)])
    assert warned == {4: [], 5: ["constant_reward"], 6: []}
    [finding] = monitor.findings
    assert (finding.first_step, finding.last_step) == (4, 6)
    assert "every sample got reward 0" in finding.message
    assert "If 0 is the reward's best value, the model already solves" in finding.message
    assert "'Calculate 12 + 30.'" in finding.message and "'42'" in finding.message
    [record] = caplog.records  # logged once, with the range when it warned
    assert record.getMessage().startswith("the run cannot learn, steps 4-5: every sample")


def test_a_constant_batch_after_rewarded_steps_says_the_rewards_are_rare():
    # GSM8K after SFT: a few correct answers early, then three batches with none
    monitor = HealthMonitor(3, max_new_tokens=32)
    warned = _run(monitor, [_signals(1, [[0.0, 1.0], [0.0, 0.0]]),
                            *(_signals(s, ZERO) for s in (2, 3, 4))])
    assert warned == {1: [], 2: [], 3: [], 4: ["constant_reward"]}
    [finding] = monitor.findings
    assert "earlier batches of this run had rewards from 0 to 1" in finding.message
    assert "too rare" in finding.message and "reward function" not in finding.message


def test_a_constant_batch_after_a_good_batch_says_the_policy_collapsed():
    # GRPO at too high a learning rate: batch means 0.25, 0.5, 0.125, then nothing right.
    # 0.125 is not a third of the way up [0, 1]; 0.5 is.
    monitor = HealthMonitor(2, max_new_tokens=8)
    batches = [[[0.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0],
                                                                    [0.0, 0.0], [0.0, 0.0]]]
    warned = _run(monitor, [*(_signals(i + 1, g) for i, g in enumerate(batches)),
                            *(_signals(s, ZERO) for s in (4, 5))])
    assert warned == {1: [], 2: [], 3: [], 4: [], 5: ["constant_reward"]}
    [finding] = monitor.findings
    assert "while the batch of step 2 had a mean reward of 0.5" in finding.message
    assert "actor.optimizer.lr" in finding.message and "too rare" not in finding.message


def test_answers_that_grew_into_the_budget_are_told_apart_from_a_short_budget():
    monitor = HealthMonitor(2, max_new_tokens=8)
    truncated = [0.5, 0.25, 0.75, 0.95, 1.0]  # step 2: a quarter cut, the least
    warned = _run(monitor, [_signals(i + 1, LEARNING, truncated=t)
                            for i, t in enumerate(truncated)])
    assert warned == {1: [], 2: [], 3: [], 4: [], 5: ["truncated"]}
    [finding] = monitor.findings
    assert finding.message.startswith("100% of the answers were cut at "
                                      "gconfig.max_new_tokens=8, while at step 2 25% were")
    assert "Raise gconfig.max_new_tokens" not in finding.message


def test_flat_groups_are_not_checked_without_a_group_baseline():
    monitor = HealthMonitor(1, max_new_tokens=32, group_baseline=False)
    assert _run(monitor, [_signals(1, FLAT)]) == {1: []}


def test_truncation_warns_from_nine_in_ten_answers_cut():
    monitor = HealthMonitor(2, max_new_tokens=16)
    truncated = [0.95, 0.875, 0.9, 1.0, 1.0]  # 0.875 < 0.9 breaks the first streak
    warned = _run(monitor, [_signals(i + 1, LEARNING, truncated=t)
                            for i, t in enumerate(truncated)])
    assert warned == {1: [], 2: [], 3: [], 4: ["truncated"], 5: []}
    [finding] = monitor.findings
    assert (finding.first_step, finding.last_step) == (3, 5)
    # the fraction of the step that warned (step 4: all cut)
    assert "100% of the answers were cut at gconfig.max_new_tokens=16" in finding.message


def test_reward_failures_warn_at_once_when_most_episode_runs_failed():
    monitor = HealthMonitor(3, max_new_tokens=32)
    # 2 groups trained; 2 failed runs is half (no warning), 3 of 5 is most
    steps = [_signals(1, LEARNING, reward_failures=2, failure="RewardError: a"),
             _signals(2, LEARNING, reward_failures=3, failure="RewardError: b")]
    assert _run(monitor, steps) == {1: [], 2: ["reward_failures"]}
    [finding] = monitor.findings
    assert "raised for 3 of 5 episode runs" in finding.message
    assert finding.message.endswith("One failure: RewardError: b")


def test_each_condition_warns_on_its_own_streak():
    monitor = HealthMonitor(2, max_new_tokens=32)
    steps = [_signals(1, ZERO, truncated=1.0), _signals(2, ZERO, truncated=1.0),
             _signals(3, FLAT, truncated=0.5), _signals(4, FLAT, truncated=0.5)]
    assert _run(monitor, steps) == {1: [], 2: ["constant_reward", "truncated"], 3: [],
                                    4: ["flat_groups"]}
    assert [(f.condition, f.first_step, f.last_step) for f in monitor.findings] == [
        ("constant_reward", 1, 2), ("truncated", 1, 2), ("flat_groups", 3, 4)]


def _traj(group, reward, stop="stop", completion=None):
    meta = {} if completion is None else {"completion": completion}
    return Trajectory(input_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1],
                      behavior_logprobs=[0.0] * 4, versions=[-1, -1, 3, 3], reward=reward,
                      group_id=group, stop_reason=stop, meta=meta)


def test_step_signals_group_the_batch_and_count_reward_failures():
    trajectories = [_traj("a", 1.0, completion="x"), _traj("a", 0.0, stop="length"),
                    _traj("b", 0.5), _traj("b", 0.5, stop="length")]
    failures = [{"error": "RewardError: boom"}, {"error": "TimeoutError: server"},
                {"error": "RewardTimeout: 10 s"}]
    s = step_signals(7, trajectories, failures, decode=lambda ids: "|".join(map(str, ids)))
    assert s.step == 7 and s.group_rewards == [[1.0, 0.0], [0.5, 0.5]]
    assert s.truncated_frac == pytest.approx(0.5) and s.episodes == 2
    assert (s.reward_failures, s.failure) == (2, "RewardError: boom")
    assert s.sample == {"prompt": "5|6", "completion": "x", "reward": 1.0}
