"""VersionSync: publish, overlap, the timing of loads reported once, failed loads retried
after the dead servers were restarted, and the announcement order."""

import asyncio
import concurrent.futures
import threading
import time

import pytest

from asyncrl.controller.versions import VersionSync
from asyncrl.inference.client.base import WeightUpdateError


class _Rollout:
    """Runs coroutines at once (submit returns a done future); records versions."""

    def __init__(self):
        self.versions = []

    def set_version(self, version):
        self.versions.append(version)

    def run_coroutine(self, coro):
        return asyncio.run(coro)

    def submit_coroutine(self, coro):
        future = concurrent.futures.Future()
        try:
            future.set_result(asyncio.run(coro))
        except Exception as e:  # noqa: BLE001 - handed to the caller, as the loop's future does
            future.set_exception(e)
        return future


class _Publisher:
    """Fails the loads of the versions in `fail` once each; logs every call."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def publish(self, trainer, version):
        self.calls.append(("publish", version))
        if version in self.fail:
            self.fail.discard(version)
            raise WeightUpdateError(f"server 0 died loading v{version}")
        return {"perf/publish_s": 0.5}

    def save(self, trainer, version):
        self.calls.append(("save", version))
        return {"perf/save_s": 0.25}

    async def load(self, version):
        self.calls.append(("load", version))
        if version in self.fail:
            self.fail.discard(version)
            raise WeightUpdateError(f"server 0 died loading v{version}")

    def close(self):
        self.calls.append(("close",))


class _Supervisor:
    def __init__(self, restarts):
        self.restarts, self.calls = restarts, 0

    def restart_dead_servers(self, checks):
        self.calls += 1
        return self.restarts


def _sync(publisher, restarts=1, overlap=True):
    rollout = _Rollout()
    supervisor = _Supervisor(restarts)
    sync = VersionSync(publisher, "trainer", rollout, supervisor, overlap=overlap)
    return sync, rollout, supervisor


def test_an_overlapped_load_is_announced_and_timed_once():
    publisher = _Publisher()
    sync, rollout, _ = _sync(publisher)
    assert sync.publish(1) == {"perf/save_s": 0.25}
    assert sync.version == 1 and rollout.versions == [1]  # the load ran (the fake runs at once)
    stats = sync.settle()
    assert list(stats) == ["perf/weights_load_s"] and stats["perf/weights_load_s"] >= 0
    assert sync.settle() == {}  # reported once
    assert publisher.calls == [("save", 1), ("load", 1)]


def test_a_load_settled_while_waiting_is_reported_by_the_next_settle():
    sync, rollout, _ = _sync(_Publisher())
    sync.publish(1)
    sync.poll()  # the trainer waited for its batch; the load had finished
    assert "perf/weights_load_s" in sync.settle()
    assert sync.settle() == {}


def test_a_failed_load_restarts_the_dead_servers_and_loads_again():
    publisher = _Publisher(fail={2})
    sync, rollout, supervisor = _sync(publisher)
    sync.publish(1)
    sync.settle()
    sync.publish(2)
    assert rollout.versions == [1]  # v2's load failed: not announced yet
    assert "perf/weights_load_s" in sync.settle()
    assert supervisor.calls == 1 and rollout.versions == [1, 2]
    assert publisher.calls == [("save", 1), ("load", 1), ("save", 2), ("load", 2), ("load", 2)]


def test_a_failed_load_with_no_dead_server_is_the_run_s_error():
    sync, rollout, supervisor = _sync(_Publisher(fail={1}), restarts=0)
    sync.publish(1)
    with pytest.raises(WeightUpdateError, match="died loading v1"):
        sync.settle()
    assert rollout.versions == [] and supervisor.calls == 1


def test_without_overlap_publish_waits_and_retries_after_a_restart():
    publisher = _Publisher(fail={1})
    sync, rollout, supervisor = _sync(publisher, overlap=False)
    assert sync.publish(1) == {"perf/publish_s": 0.5}
    assert publisher.calls == [("publish", 1), ("publish", 1)]
    assert rollout.versions == [1] and supervisor.calls == 1
    # a resumed run's first publish never overlaps, whatever the setting
    sync.overlap = True
    sync.publish(2, overlap=False)
    assert publisher.calls[-1] == ("publish", 2) and rollout.versions == [1, 2]


class _LoopRollout(_Rollout):
    """Runs coroutines on an event loop in a thread, as the rollout controller does."""

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit_coroutine(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.mark.parametrize("outcome", ["ends", "fails"])
def test_an_overlapped_load_waits_for_the_work_reading_the_held_weights(outcome):
    publisher, rollout = _Publisher(), _LoopRollout()
    sync = VersionSync(publisher, "trainer", rollout, _Supervisor(1), overlap=True)
    evaluation = concurrent.futures.Future()
    try:
        assert sync.publish(2, after=evaluation) == {"perf/save_s": 0.25}  # not waiting
        time.sleep(0.1)
        assert publisher.calls == [("save", 2)] and rollout.versions == []  # held back
        if outcome == "ends":
            evaluation.set_result(0.5)
        else:
            evaluation.set_exception(RuntimeError("evaluation failed on all 4 items"))
        sync.settle()
        assert publisher.calls == [("save", 2), ("load", 2)] and rollout.versions == [2]
    finally:
        rollout.close()


def test_without_overlap_publish_waits_for_the_work_reading_the_held_weights():
    publisher, done = _Publisher(), []
    sync, rollout, _ = _sync(publisher, overlap=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        evaluation = pool.submit(lambda: (time.sleep(0.1), done.append("evaluation")))
        sync.publish(1, after=evaluation)
        done.append("publish")
    assert done == ["evaluation", "publish"] and publisher.calls == [("publish", 1)]
