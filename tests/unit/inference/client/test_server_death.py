"""A dead inference server: the cause line read from its log, and requests moved off a
server that answers 500 while it dies."""

import asyncio

from server_logs import CAUSE, VLLM_DEATH

from asyncrl.launch.base import cause_line, log_size


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


def _client_and_servers():
    from fake_vllm import FakeVLLMServers

    from asyncrl.inference.client.vllm import VLLMClient

    servers = FakeVLLMServers(2, token_s=0.001)
    client = VLLMClient(servers.addresses, request_timeout=10,
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
