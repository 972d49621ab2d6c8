"""A dead inference server: the cause line read from its log, a restart for a new cause,
one clear error for a server that dies the same way again, and requests moved off a server
that answers 500 while it dies."""

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.controller.rl import RLTrainer
from asyncrl.launch.base import Worker, WorkerDiedError, cause_line, log_size

# The lines a vLLM CPU server wrote when a split prefill met a seeded request (shortened).
VLLM_DEATH = """\
(APIServer pid=1) WARNING [system_utils.py:255] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit. This can cause fd \
limit errors like `OSError: [Errno 24] Too many open files`.
(APIServer pid=1) INFO [api_server.py:100] Starting vLLM server on http://127.0.0.1:8000
(Worker pid=3) ERROR [multiproc_executor.py:1063]   File "gpu_model_runner.py", line 3502
(Worker pid=3) ERROR [multiproc_executor.py:1063]     gen.set_offset(gen.get_offset() - 4)
(Worker pid=3) ERROR [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: Worker failed with error 'CPU Generator \
does not use offset', please check the stack trace above for the root cause
(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: \
EngineCore encountered an issue. See stack trace (above) for the root cause.
"""
CAUSE = "RuntimeError: CPU Generator does not use offset"


def test_the_cause_line_is_the_first_error_not_a_warning_or_a_consequence(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    assert cause_line(log) == CAUSE
    # a restarted server appends to the same log: its own part starts at the old size
    start = log_size(log)
    log.write_text(VLLM_DEATH + "INFO started again\nValueError: bad weights file\n")
    assert cause_line(log, start) == "ValueError: bad weights file"
    assert cause_line(log, log_size(log)) is None
    assert cause_line(tmp_path / "missing.log") is None and log_size(tmp_path / "x") == 0


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


def _trainer(scheduler) -> RLTrainer:
    """An RLTrainer with only what restarting servers needs."""
    trainer = object.__new__(RLTrainer)
    trainer.scheduler, trainer.server_restarts = scheduler, 0
    trainer.cfg = SimpleNamespace(rollout=SimpleNamespace(backend="vllm"))
    trainer._failed_checks, trainer._death_causes, trainer.inference_log_starts = {}, {}, {}
    trainer.engine = SimpleNamespace(addresses=[scheduler.worker.address],
                                     check_servers=lambda: asyncio.sleep(0))
    trainer.rollout = SimpleNamespace(run_coroutine=asyncio.run)
    trainer.agents, trainer.routed = None, False
    return trainer


def test_a_server_that_dies_the_same_way_again_stops_the_run_with_its_cause(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    trainer = _trainer(scheduler)
    scheduler.next_death = VLLM_DEATH  # the restarted server will die the same way
    assert trainer._restart_dead_servers(checks=1) == 1
    assert scheduler.restarts == 1 and trainer.server_restarts == 1
    with pytest.raises(WorkerDiedError) as err:
        trainer._restart_dead_servers(checks=1)
    assert scheduler.restarts == 1  # not restarted a second time
    message = str(err.value)
    assert "inference server 0 (http://127.0.0.1:1, backend vllm)" in message
    assert f"died again the way it died before: {CAUSE}" in message
    assert f"Its log: {log}" in message


def test_a_server_that_dies_of_something_new_is_restarted_again(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    trainer = _trainer(scheduler)
    for death in ("MemoryError: out of memory\n", "OSError: disk full\n", ""):
        scheduler.next_death = death
        trainer._restart_dead_servers(checks=1)
    # CPU generator, then out of memory, then disk full: three causes, three restarts; the
    # third life ended with nothing in its log (killed), which is never "the same way"
    assert scheduler.restarts == 3
    scheduler.next_death = ""
    trainer._restart_dead_servers(checks=1)
    assert scheduler.restarts == 4
    assert trainer._death_causes == {0: None}


def test_two_failed_checks_in_a_row_are_needed_by_default(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    trainer = _trainer(scheduler)
    assert trainer._restart_dead_servers() == 0  # one failed check: wait for a second
    assert trainer._restart_dead_servers() == 1 and scheduler.restarts == 1


def _client_and_servers():
    from fake_vllm import FakeVLLMServers

    from asyncrl.inference.client.vllm import VLLMInferenceEngine

    servers = FakeVLLMServers(2, token_s=0.001)
    client = VLLMInferenceEngine(servers.addresses, request_timeout=10,
                                 update_weights_timeout=10, health_check_interval=None)
    return client, servers


def _generate_all(client, n):
    from asyncrl.api import GenerationRequest, SamplingParams

    async def run():
        return await asyncio.gather(*(client.agenerate(GenerationRequest(
            input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, seed=i)))
            for i in range(n)), return_exceptions=True)
    return asyncio.run(run())


def test_requests_leave_a_server_that_answers_500_and_then_fails_its_health_check():
    client, servers = _client_and_servers()
    servers.errors[0], servers.healthy[0] = True, False  # its engine died
    results = _generate_all(client, 6)
    assert [r.output_ids for r in results] == [[3, 4]] * 6  # all served by server 1
    assert list(client.down_servers) == [servers.addresses[0]]
    failed = [c for c in servers.calls if c[0] == 0 and c[1] == "/v1/completions"]
    done = [c for c in servers.calls if c[0] == 1 and c[1] == "/v1/completions"]
    assert len(done) == 6 and 1 <= len(failed) <= 6
    asyncio.run(client.close())


def test_a_500_from_a_healthy_server_is_the_request_s_error():
    from asyncrl.inference.client.base import ServerStatusError

    client, servers = _client_and_servers()
    servers.errors = [True, True]  # both answer 500 yet pass their health checks
    results = _generate_all(client, 2)
    assert all(isinstance(r, ServerStatusError) and r.status == 500 for r in results)
    assert client.down_servers == {}
    asyncio.run(client.close())


def test_a_run_that_stops_on_a_dead_server_names_the_error_of_its_present_life(tmp_path):
    from asyncrl.controller.rl import _raise_if_dead
    from asyncrl.launch.base import SchedulerError

    log = tmp_path / "inference-0.log"
    log.write_text(VLLM_DEATH)
    scheduler = _Scheduler(log)
    scheduler.get_workers = lambda role: [scheduler.worker] if role == "inference" else []
    trainer = _trainer(scheduler)
    scheduler.next_death = "MemoryError: out of memory\n"
    trainer._restart_dead_servers(checks=1)  # its second life ends with another error
    with pytest.raises(SchedulerError, match="is down: MemoryError: out of memory;"):
        _raise_if_dead(scheduler, trainer.inference_log_starts)
