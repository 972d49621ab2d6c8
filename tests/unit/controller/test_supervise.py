"""Supervisor: a restart for a new cause of death, one clear error for a server that dies the
same way again, two failed checks before a restart, and the error a stopped run names."""

import asyncio
from types import SimpleNamespace

import pytest
from server_logs import CAUSE, VLLM_DEATH

from asyncrl.controller.supervise import Supervisor
from asyncrl.launch.base import Worker, WorkerDiedError


class _Scheduler:
    """One inference server that fails every health check; each restart appends what
    `next_death` holds to its log (what the new process will die of)."""

    def __init__(self, log):
        self.log, self.restarts, self.next_death = log, 0, ""
        self.worker = Worker("inference", 0, "127.0.0.1", 1, "http://127.0.0.1:1", "local", 1,
                             str(log))

    def check_health(self, role):
        return [False]

    def get_workers(self, role):
        return [self.worker]

    def restart_worker(self, role, index):
        self.restarts += 1
        with open(self.log, "a") as f:
            f.write("INFO starting\n" + self.next_death)
        return self.worker


def _supervisor(scheduler) -> Supervisor:
    """A supervisor of one vLLM server with a client that knows its address."""
    engine = SimpleNamespace(addresses=[scheduler.worker.address],
                             check_servers=lambda: asyncio.sleep(0))
    return Supervisor(scheduler, engine, SimpleNamespace(run_coroutine=asyncio.run),
                      backend="vllm")


def test_a_server_that_dies_the_same_way_again_stops_the_run_with_its_cause(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    supervisor = _supervisor(scheduler)
    scheduler.next_death = VLLM_DEATH  # the restarted server will die the same way
    assert supervisor.restart_dead_servers(checks=1) == 1
    assert scheduler.restarts == 1 and supervisor.server_restarts == 1
    with pytest.raises(WorkerDiedError) as err:
        supervisor.restart_dead_servers(checks=1)
    assert scheduler.restarts == 1  # not restarted a second time
    message = str(err.value)
    assert "inference server 0 (http://127.0.0.1:1, backend vllm)" in message
    assert f"died again the way it died before: {CAUSE}" in message
    assert f"Its log: {log}" in message


def test_a_server_that_dies_of_something_new_is_restarted_again(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    supervisor = _supervisor(scheduler)
    for death in ("MemoryError: out of memory\n", "OSError: disk full\n", ""):
        scheduler.next_death = death
        supervisor.restart_dead_servers(checks=1)
    # CPU generator, then out of memory, then disk full: three causes, three restarts; the
    # third life ended with nothing in its log (killed), which is never "the same way"
    assert scheduler.restarts == 3
    scheduler.next_death = ""
    supervisor.restart_dead_servers(checks=1)
    assert scheduler.restarts == 4
    assert supervisor._death_causes == {0: None}


def test_two_failed_checks_in_a_row_are_needed_by_default(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    supervisor = _supervisor(scheduler)
    assert supervisor.restart_dead_servers() == 0  # one failed check: wait for a second
    assert supervisor.restart_dead_servers() == 1 and scheduler.restarts == 1


def test_a_run_that_stops_on_a_dead_server_names_the_error_of_its_present_life(tmp_path):
    from asyncrl.launch.base import SchedulerError

    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    scheduler.get_workers = lambda role: [scheduler.worker] if role == "inference" else []
    supervisor = _supervisor(scheduler)
    scheduler.next_death = "MemoryError: out of memory\n"
    supervisor.restart_dead_servers(checks=1)  # its second life ends with another error
    with pytest.raises(SchedulerError, match="is down: MemoryError: out of memory;"):
        supervisor.raise_if_dead()
