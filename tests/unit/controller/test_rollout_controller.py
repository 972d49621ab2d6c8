"""The rollout controller with a fake workflow: staleness bound, failures, exact resume."""

import asyncio
import random
import time

import pytest

from asyncrl.api import StopReason, Trajectory
from asyncrl.api.types import SAMPLING_SEED_KEY, mix_seed
from asyncrl.controller.rollout import RolloutController, RolloutError


class ListStream:
    """Items 0, 1, 2, ... in order, with a resumable position."""

    def __init__(self):
        self.position = 0

    def next(self):
        item = {"id": str(self.position), "n": self.position}
        self.position += 1
        return item

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class FakeEngine:
    async def close(self):
        pass


class SleepyWorkflow:
    """Each episode sleeps a random time (so episodes finish out of order)."""

    def __init__(self, group_size=2, seed=0, fail_ids=(), slow_ids=(), max_delay=0.02,
                 min_delay=0.0):
        self.rng = random.Random(seed)
        self.group_size = group_size
        self.fail_ids = set(fail_ids)
        self.slow_ids = set(slow_ids)
        self.max_delay, self.min_delay = max_delay, min_delay

    async def run(self, engine, item):
        delay = (0.3 if item["n"] in self.slow_ids
                 else self.rng.uniform(self.min_delay, self.max_delay))
        await asyncio.sleep(delay)
        if item["n"] in self.fail_ids:
            raise ValueError(f"reward crashed on {item['n']}")
        return [
            Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0, -1, -1],
                       versions=[-1, 0, 0], reward=float(item["n"] % 2), group_id=item["id"],
                       stop_reason=StopReason.STOP, meta={"item": item["n"]})
            for _ in range(self.group_size)
        ]


def make_controller(eta, B=4, workflow=None, max_concurrent=None, max_failed=16, seed=None,
                    admission="bound"):
    return RolloutController(
        FakeEngine(), workflow or SleepyWorkflow(), ListStream(), consumer_batch_size=B,
        max_head_offpolicyness=eta, max_concurrent_rollouts=max_concurrent or B * (eta + 1),
        max_failed_episodes=max_failed, seed=seed, admission=admission)


def state_after(ctrl, n_steps):
    """Run `ctrl` for `n_steps` steps, stop it, and return its state (a checkpoint's)."""
    ctrl.start()
    try:
        run_steps(ctrl, n_steps)
        return ctrl.state_dict()
    finally:
        ctrl.stop()


def run_steps(ctrl, n_steps, start=0):
    batches = []
    for step in range(start, start + n_steps):
        batch, stats = ctrl.next_batch(timeout=30)
        batches.append((step, batch, stats))
        ctrl.set_version(step + 1)
    return batches


@pytest.mark.parametrize("admission", ["bound", "demand"])
@pytest.mark.parametrize("eta, slow_ids", [(0, {5}), (1, {5}), (3, {5}), (3, {1, 5, 6, 9, 14}),
                                           (2, {0, 1, 2, 3, 12})])
def test_every_trajectory_in_every_batch_respects_the_staleness_bound(eta, slow_ids, admission):
    # Slow items are overtaken by later ones, yet each must be trained within eta versions.
    ctrl = make_controller(eta, workflow=SleepyWorkflow(slow_ids=slow_ids, seed=eta),
                           admission=admission)
    ctrl.start()
    try:
        batches = run_steps(ctrl, 8)
    finally:
        ctrl.stop()
    seen = []
    for step, batch, stats in batches:
        assert len(batch) == 4 * 2  # B episodes of group size 2
        for t in batch:
            assert 0 <= step - t.start_version <= eta
        assert stats["rollout/staleness_max"] <= eta
        seen += [t.meta["item"] for t in batch.trajectories[::2]]
    assert len(seen) == len(set(seen)) == 32
    if eta == 0:
        # synchronous: batch k holds exactly the items submitted at version k
        assert sorted(seen[:4]) == [0, 1, 2, 3]


@pytest.mark.parametrize("eta, slow_ids", [(0, {5}), (1, {5}), (3, {1, 5, 6, 9, 14})])
def test_the_bound_holds_when_the_servers_learn_each_version_late(eta, slow_ids):
    # actor.weight_update_overlap: the trainer takes batch k at its own version k while the
    # servers still load k (announced 0-40 ms later, from another thread, in order).
    import threading

    ctrl = make_controller(eta, workflow=SleepyWorkflow(slow_ids=slow_ids, seed=eta))
    rng, timers = random.Random(eta), []
    ctrl.start()
    try:
        for step in range(8):
            batch, stats = ctrl.next_batch(timeout=30, version=step)
            for t in batch:
                assert 0 <= step - t.start_version <= eta
            assert stats["rollout/staleness_max"] == max(step - t.start_version for t in batch)
            if timers:  # as the trainer: the previous load ends before the next begins
                timers[-1].join()
            timers.append(threading.Timer(rng.uniform(0, 0.04), ctrl.set_version, (step + 1,)))
            timers[-1].start()
        for timer in timers:
            timer.join()
        with pytest.raises(ValueError, match="servers hold version 8"):
            ctrl.next_batch(timeout=1, version=7)
    finally:
        ctrl.stop()


def train_steps(ctrl, n_steps, step_s):
    """As the trainer: take a batch, train `step_s` seconds, publish the next version."""
    out = []
    for step in range(n_steps):
        batch, stats = ctrl.next_batch(timeout=30)
        out.append((step, batch, stats))
        time.sleep(step_s)
        ctrl.set_version(step + 1)
    return out


@pytest.mark.parametrize("admission, stale_at_the_end", [("bound", 4), ("demand", 1)])
def test_demand_admission_keeps_batches_fresh_when_generation_outruns_training(
        admission, stale_at_the_end):
    # Episodes take <= 5 ms, a step 100 ms. Under "bound" every episode eta allows starts at
    # once, so from step 4 on each batch was started 4 versions before (the bound). Under
    # "demand" the trainer never waits, so episodes start one version ahead: staleness 1.
    ctrl = make_controller(4, workflow=SleepyWorkflow(max_delay=0.005), admission=admission)
    ctrl.start()
    try:
        batches = train_steps(ctrl, 8, step_s=0.1)
    finally:
        ctrl.stop()
    staleness = [stats["rollout/staleness_max"] for _, _, stats in batches]
    assert staleness[4:] == [stale_at_the_end] * 4
    assert max(staleness) == stale_at_the_end
    ahead = [stats["rollout/ahead"] for _, _, stats in batches]
    assert ahead == [4.0 if admission == "bound" else 1.0] * 8


def test_demand_admission_goes_ahead_to_eta_when_the_trainer_waits_and_resumes_there():
    # Episodes take 50-100 ms and the trainer none: it waits for its batches, so each wait
    # lets episodes start one version further ahead (from 1), up to eta = 3, not past it.
    eta = 3
    workflow = SleepyWorkflow(min_delay=0.05, max_delay=0.1)
    ctrl = make_controller(eta, workflow=workflow, admission="demand")
    ctrl.start()
    try:
        batches = train_steps(ctrl, 8, step_s=0.0)
        state = ctrl.state_dict()
    finally:
        ctrl.stop()
    ahead = [stats["rollout/ahead"] for _, _, stats in batches]
    assert ahead[0] == 1.0  # the first batch always waits: no change
    assert (max(ahead), ahead[-1]) == (3.0, 3.0)
    assert max(stats["rollout/staleness_max"] for _, _, stats in batches) <= eta
    resumed = make_controller(eta, admission="demand")
    resumed.load_state_dict(state)
    assert resumed.staleness.ahead == 3


def test_demand_admission_stays_one_version_ahead_where_cores_are_shared():
    # The same waiting trainer, but its waits lend its cores to the servers (grow_ahead off).
    ctrl = RolloutController(
        FakeEngine(), SleepyWorkflow(min_delay=0.05, max_delay=0.1), ListStream(),
        consumer_batch_size=4, max_head_offpolicyness=3, max_concurrent_rollouts=16,
        admission="demand", grow_ahead=False)
    ctrl.start()
    try:
        batches = train_steps(ctrl, 5, step_s=0.0)
    finally:
        ctrl.stop()
    assert [stats["rollout/ahead"] for _, _, stats in batches] == [1.0] * 5
    # after taking batch k at version k: accepted + running < (1 + k + 1) * B, of which
    # (k + 1) * B are consumed, so at most one batch (B = 4) is in flight or finished
    assert all(stats["rollout/running"] + stats["rollout/buffered"] <= 4
               for _, _, stats in batches)
    # (an episode may still finish after later ones and be trained one step later)
    assert max(stats["rollout/staleness_max"] for _, _, stats in batches) <= 3


@pytest.mark.parametrize("admission, first_wave", [("bound", 12), ("demand", 4)])
def test_demand_admission_generates_the_first_batch_alone(admission, first_wave):
    # Before the first batch is handed out "bound" starts (eta + 1) * B = 12 episodes and
    # "demand" B = 4, so that batch does not share the servers with the next; after it,
    # "demand" starts the next batch (one version ahead): 8 started in all.
    ctrl = make_controller(2, workflow=SleepyWorkflow(min_delay=0.3, max_delay=0.3),
                           admission=admission)
    ctrl.start()
    try:
        time.sleep(0.1)
        assert ctrl.staleness.running == first_wave
        ctrl.next_batch(timeout=30)
        time.sleep(0.1)
        assert ctrl.stream.position == (12 if admission == "bound" else 8)
    finally:
        ctrl.stop()


def test_an_unknown_admission_rule_is_refused():
    with pytest.raises(ValueError, match="rollout.admission must be 'bound' or 'demand'"):
        make_controller(1, admission="eager")


def test_groups_stay_contiguous_in_a_batch():
    ctrl = make_controller(1, workflow=SleepyWorkflow(group_size=3))
    ctrl.start()
    try:
        (_, batch, _), = run_steps(ctrl, 1)
    finally:
        ctrl.stop()
    ids = batch.group_ids
    assert [ids[i] for i in range(0, 12, 3)] == [ids[i + 2] for i in range(0, 12, 3)]


def test_failed_episodes_are_counted_and_replaced():
    ctrl = make_controller(0, workflow=SleepyWorkflow(fail_ids={1, 2}))
    ctrl.start()
    try:
        (_, batch, stats), = run_steps(ctrl, 1)
    finally:
        ctrl.stop()
    items = sorted({t.meta["item"] for t in batch})
    assert items == [0, 3, 4, 5]
    assert stats["rollout/episodes_failed"] == 2


class FlakyWorkflow(SleepyWorkflow):
    """Items in `flaky_ids` fail on their first run only; items in `fail_ids` on every run."""

    def __init__(self, flaky_ids, **kwargs):
        super().__init__(**kwargs)
        self.flaky_ids = set(flaky_ids)
        self.runs: dict[int, int] = {}

    async def run(self, engine, item):
        self.runs[item["n"]] = self.runs.get(item["n"], 0) + 1
        if item["n"] in self.flaky_ids and self.runs[item["n"]] == 1:
            await asyncio.sleep(0.01)
            raise TimeoutError(f"reward timed out on {item['n']}")
        return await super().run(engine, item)


def test_a_failed_episode_is_run_again_as_configured_and_every_run_is_reported():
    workflow = FlakyWorkflow(flaky_ids={1, 4}, fail_ids={2})
    ctrl = RolloutController(FakeEngine(), workflow, ListStream(), consumer_batch_size=4,
                             max_head_offpolicyness=0, max_concurrent_rollouts=4,
                             episode_retries=1)
    ctrl.start()
    try:
        (_, batch, stats), = run_steps(ctrl, 1)
        reports = ctrl.take_failures()
    finally:
        ctrl.stop()
    # 1 and 4 came back on their second run; 2 failed twice and is reported, not trained.
    assert sorted({t.meta["item"] for t in batch}) == [0, 1, 3, 4]
    assert workflow.runs[1] == workflow.runs[4] == workflow.runs[2] == 2
    assert stats["rollout/episodes_retried"] == 3 and stats["rollout/episodes_failed"] == 1
    runs = sorted((r["item_id"], r["run"], r["retried"]) for r in reports)
    assert runs == [("1", 1, True), ("2", 1, True), ("2", 2, False), ("4", 1, True)]
    assert all("Error: reward" in r["error"] for r in reports)
    assert ctrl.take_failures() == []  # each report is handed out once


def test_episode_retries_must_not_be_negative():
    with pytest.raises(ValueError, match="episode_retries must be >= 0"):
        RolloutController(FakeEngine(), SleepyWorkflow(), ListStream(), consumer_batch_size=4,
                          max_head_offpolicyness=0, max_concurrent_rollouts=4,
                          episode_retries=-1)


def test_too_many_failures_stop_the_run_with_the_causes():
    ctrl = make_controller(0, workflow=SleepyWorkflow(fail_ids=set(range(100))), max_failed=3)
    ctrl.start()
    try:
        with pytest.raises(RolloutError, match=r"episodes failed \(rollout.max_failed_episodes=3\)"
                                               r"(.|\n)*reward crashed on"):
            ctrl.next_batch(timeout=30)
    finally:
        ctrl.stop()


def test_resume_loses_and_repeats_no_item():
    eta, B = 2, 4
    ctrl = make_controller(eta, B=B)
    ctrl.start()
    try:
        first = run_steps(ctrl, 3)
        state = ctrl.state_dict()
    finally:
        ctrl.stop()
    trained_before = [t.meta["item"] for _, b, _ in first for t in b.trajectories[::2]]
    pending = [item["n"] for item in state["pending"]]
    buffered = [e.trajectories[0].meta["item"] for e in state["buffer"]]
    # everything pulled from the stream is trained, buffered or pending: nothing lost
    assert sorted(trained_before + pending + buffered) == list(range(state["stream"]["position"]))

    resumed = make_controller(eta, B=B)
    resumed.load_state_dict(state)
    assert resumed.version == 3
    resumed.start()
    try:
        second = run_steps(resumed, 4, start=3)
    finally:
        resumed.stop()
    trained_after = [t.meta["item"] for _, b, _ in second for t in b.trajectories[::2]]
    assert not set(trained_before) & set(trained_after)
    # work in flight or buffered at the checkpoint started by version 3, so it is trained
    # by step 3 + eta at the latest
    assert set(pending + buffered) <= set(trained_after)
    for step, batch, _ in second:
        for t in batch:
            assert step - t.start_version <= eta
    # the staleness counters continue: accepted counts every episode ever accepted
    assert resumed.staleness.accepted >= (3 + 4) * B


class SeedRecordingWorkflow(SleepyWorkflow):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.seeds = {}

    async def run(self, engine, item):
        self.seeds.setdefault(item["n"], []).append(item.get(SAMPLING_SEED_KEY))
        return await super().run(engine, item)


def test_each_drawn_item_gets_its_seed_by_draw_number_and_keeps_it_over_a_resume():
    eta, B = 1, 4
    first = SeedRecordingWorkflow()
    state = state_after(make_controller(eta, B=B, workflow=first, seed=11), 2)
    second = SeedRecordingWorkflow()
    resumed = make_controller(eta, B=B, workflow=second, seed=11)
    resumed.load_state_dict(state)
    resumed.start()
    try:
        run_steps(resumed, 2, start=2)
    finally:
        resumed.stop()
    # item n is draw n + 1 of the run, before and after the resume; an item in flight at
    # the checkpoint is run again with the seed it had
    for workflow in (first, second):
        for n, seeds in workflow.seeds.items():
            assert seeds == [mix_seed(11, n + 1)] * len(seeds)
    assert state["drawn"] == state["stream"]["position"] > 0
    rerun = {item["n"] for item in state["pending"]}
    assert rerun and rerun <= set(first.seeds) & set(second.seeds)
    unseeded = make_controller(eta, B=B, workflow=SeedRecordingWorkflow())
    unseeded.start()
    try:
        run_steps(unseeded, 1)
        assert set(map(tuple, unseeded.workflow.seeds.values())) == {(None,)}
    finally:
        unseeded.stop()


class DeadEngineWorkflow(SleepyWorkflow):
    async def run(self, engine, item):
        from asyncrl.api import InferenceError

        raise InferenceError("server http://127.0.0.1:1 unreachable after 3 retries")


def test_a_dead_engine_stops_the_run_at_once_and_keeps_the_item():
    ctrl = make_controller(0, workflow=DeadEngineWorkflow(), max_failed=100)
    ctrl.start()
    try:
        with pytest.raises(RolloutError, match="InferenceError: server http://127.0.0.1:1 unreachable"):
            ctrl.next_batch(timeout=30)
    finally:
        ctrl.stop()
    # no more episodes start, and every item taken from the stream is kept for a resume
    state = ctrl.state_dict()
    assert sorted(item["n"] for item in state["pending"]) == list(range(state["stream"]["position"]))


# ---- dynamic sampling (DAPO): groups of equal rewards are dropped -----------------------------

class MixedRewardWorkflow(SleepyWorkflow):
    """Items 0, 3, 6, ... get rewards [0, 1] (kept); every other item's group is all 0 or 1."""

    async def run(self, engine, item):
        trajectories = await super().run(engine, item)
        for i, t in enumerate(trajectories):
            t.reward = float(i % 2) if item["n"] % 3 == 0 else float(item["n"] % 2)
        return trajectories


def make_dapo_controller(eta, B=4, workflow=None):
    from asyncrl.controller.rollout import has_reward_signal

    return RolloutController(
        FakeEngine(), workflow or MixedRewardWorkflow(), ListStream(), consumer_batch_size=B,
        max_head_offpolicyness=eta, max_concurrent_rollouts=B * (eta + 1),
        should_accept=has_reward_signal)


def test_dynamic_sampling_fills_each_batch_with_groups_that_have_a_reward_signal():
    # eta = 0, B = 4: a batch needs the next 4 items n % 3 == 0, and the admission rule
    # (accepted + running < (v + 1) * 4) starts nothing after the 4th of them. So batch 1 is
    # items 0, 3, 6, 9 after dropping 1, 2, 4, 5, 7, 8 (6 groups); batch 2 is 12 .. 21 after
    # dropping 10, 11, 13, 14, 16, 17, 19, 20 (8); batch 3 likewise 8 more.
    ctrl = make_dapo_controller(0)
    ctrl.start()
    try:
        batches = run_steps(ctrl, 2)
        batch, stats = ctrl.next_batch(timeout=30)
        batches.append((2, batch, stats))
        # read before version 3 admits the next episodes: a dropped group frees its slot
        # like a rejected one, so nothing is left running
        rejected, running = ctrl.staleness.rejected, ctrl.staleness.running
    finally:
        ctrl.stop()
    items = [sorted({t.meta["item"] for t in b}) for _, b, _ in batches]
    assert items == [[0, 3, 6, 9], [12, 15, 18, 21], [24, 27, 30, 33]]
    assert [s["rollout/groups_dropped"] for _, _, s in batches] == [6, 8, 8]
    assert [s["rollout/groups_dropped_total"] for _, _, s in batches] == [6, 14, 22]
    assert all(s["rollout/episodes_accepted"] == 4 * (k + 1) for k, (_, _, s) in enumerate(batches))
    assert (rejected, running) == (22, 0)


@pytest.mark.parametrize("eta", [1, 3])
def test_dynamic_sampling_keeps_the_staleness_bound(eta):
    # Slow kept items are overtaken by later ones while dropped groups are replaced.
    ctrl = make_dapo_controller(eta, workflow=MixedRewardWorkflow(slow_ids={0, 6, 15}, seed=eta))
    ctrl.start()
    try:
        batches = run_steps(ctrl, 6)
    finally:
        ctrl.stop()
    for step, batch, stats in batches:
        assert len(batch) == 4 * 2
        for t in batch:
            assert 0 <= step - t.start_version <= eta
            assert t.meta["item"] % 3 == 0
        assert stats["rollout/staleness_max"] <= eta
    totals = [s["rollout/groups_dropped_total"] for _, _, s in batches]
    assert sum(s["rollout/groups_dropped"] for _, _, s in batches) == totals[-1] > 0


def test_dynamic_sampling_counters_survive_a_resume():
    state = state_after(make_dapo_controller(0), 2)
    resumed = make_dapo_controller(0)
    resumed.load_state_dict(state)
    resumed.start()
    try:
        ((_, batch, stats),) = run_steps(resumed, 1, start=2)
    finally:
        resumed.stop()
    # the same batch 3 as without the resume (see the test above): 8 dropped, 22 in total
    assert sorted({t.meta["item"] for t in batch}) == [24, 27, 30, 33]
    assert stats["rollout/groups_dropped"] == 8
    assert stats["rollout/groups_dropped_total"] == 22


def test_dropping_every_group_warns_with_the_counts(caplog, monkeypatch):
    from asyncrl.controller.rollout import controller as controller_module

    monkeypatch.setattr(controller_module, "DROP_WARN_GROUPS_PER_BATCH", 1)
    # SleepyWorkflow gives all samples of an item the same reward: every group is dropped.
    ctrl = make_dapo_controller(0, B=2, workflow=SleepyWorkflow(max_delay=0.0))
    ctrl.start()
    try:
        with caplog.at_level("WARNING", logger="asyncrl.controller.rollout.controller"):
            with pytest.raises(TimeoutError, match="0/2 episodes ready"):
                ctrl.next_batch(timeout=1)
    finally:
        ctrl.stop()
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()]
    assert warnings and warnings[0].startswith(
        "dynamic sampling dropped the last 2 finished groups in a row (2 dropped, 0 kept")


def test_a_filter_that_raises_counts_as_a_failed_episode():
    def broken(trajectories):
        raise KeyError("score")

    ctrl = RolloutController(FakeEngine(), SleepyWorkflow(), ListStream(), consumer_batch_size=2,
                             max_head_offpolicyness=0, max_concurrent_rollouts=2,
                             max_failed_episodes=1, should_accept=broken)
    ctrl.start()
    try:
        with pytest.raises(RolloutError, match="KeyError: 'score'"):
            ctrl.next_batch(timeout=30)
    finally:
        ctrl.stop()


def test_external_episodes_follow_the_staleness_bound_and_start_at_the_current_version():
    """Online sessions: started from outside, refused beyond (eta + v + 1) * B."""
    ctrl = RolloutController(FakeEngine(), SleepyWorkflow(), None, consumer_batch_size=2,
                             max_head_offpolicyness=0, max_concurrent_rollouts=8)
    ctrl.start()
    finish = {}

    def make(version):
        done = asyncio.get_running_loop().create_future()
        handle = f"s{len(finish)}@v{version}"
        finish[handle] = done

        async def run():
            return await done
        return handle, run

    async def try_start():
        return ctrl.start_external(make)

    def traj(handle):
        return [Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0, -1],
                           versions=[-1, 0], reward=1.0, group_id=handle)]

    try:
        started = [ctrl.run_coroutine(try_start(), timeout=5) for _ in range(3)]
        assert started == ["s0@v0", "s1@v0", None]  # (0 + 0 + 1) * 2 = 2 at version 0
        for h in started[:2]:
            ctrl.run_coroutine(_resolve(finish[h], traj(h)), timeout=5)
        batch, stats = ctrl.next_batch(timeout=5)
        assert sorted(t.group_id for t in batch) == ["s0@v0", "s1@v0"]
        assert ctrl.run_coroutine(try_start(), timeout=5) is None  # still version 0
        ctrl.set_version(1)
        assert ctrl.run_coroutine(try_start(), timeout=5) == "s2@v1"
        # A rejected (None) external episode frees its slot.
        ctrl.run_coroutine(_resolve(finish["s2@v1"], None), timeout=5)
        assert ctrl.run_coroutine(try_start(), timeout=5) == "s3@v1"
        assert "pending" in ctrl.state_dict() and ctrl.state_dict()["pending"] == []
    finally:
        ctrl.stop()


async def _resolve(future, value):
    future.set_result(value)
    await asyncio.sleep(0.05)  # let the episode finish on the loop
