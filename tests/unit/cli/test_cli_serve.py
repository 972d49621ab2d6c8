"""`asyncrl serve` backend plumbing."""

from __future__ import annotations

import pytest

from asyncrl.cli import build_parser
from asyncrl.inference import gateway
from asyncrl.inference.client.local import LocalServerClient
from asyncrl.inference.client.sglang import SGLangClient
from asyncrl.inference.client.vllm import VLLMClient


def test_serve_defaults_to_the_local_backend_on_loopback():
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.backend == "local" and args.host == "127.0.0.1" and args.device == "auto"


@pytest.mark.parametrize("backend,cls", [("local", LocalServerClient),
                                         ("vllm", VLLMClient),
                                         ("sglang", SGLangClient)])
def test_gateway_builds_the_client_of_each_backend(backend, cls):
    engine = gateway.make_engine(backend, "127.0.0.1:1", api_key=None)
    assert type(engine) is cls and engine.addresses == ["http://127.0.0.1:1"]


def test_gateway_needs_a_tokenizer_for_backends_that_do_not_report_their_model(monkeypatch):
    import asyncio

    async def healthy(self, timeout):
        return None

    monkeypatch.setattr(VLLMClient, "wait_healthy", healthy)
    with pytest.raises(SystemExit, match="--tokenizer is needed with --backend vllm"):
        asyncio.run(gateway.serve("vllm", "127.0.0.1:1", tokenizer=None, model_name=None,
                                  host="127.0.0.1", port=0))


def test_serve_names_the_missing_backend_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang" else real(name, *a))
    args = build_parser().parse_args(["serve", "--model", "m", "--backend", "sglang"])
    with pytest.raises(SystemExit, match=r"needs the sglang package \(pip install sglang\)"):
        args.func(args)


def test_serve_stops_with_the_scheduler_s_error_when_its_server_dies():
    import asyncio

    from asyncrl.cli import _while_alive
    from asyncrl.launch.base import SchedulerError

    class Scheduler:
        checks = 0

        def check_alive(self):
            self.checks += 1
            if self.checks == 3:
                raise SchedulerError("inference 0 died (exit code 0): RuntimeError: boom")

    cancelled = []

    async def serving():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    scheduler = Scheduler()
    with pytest.raises(SchedulerError, match="RuntimeError: boom"):
        asyncio.run(_while_alive(scheduler, serving(), interval=0.01))
    assert scheduler.checks == 3 and cancelled == [True]  # the gateway stopped with it

    async def returns():
        await asyncio.sleep(0.03)
        return "done"

    alive = Scheduler()
    alive.check_alive = lambda: None
    asyncio.run(_while_alive(alive, returns(), interval=0.01))  # a clean end: no error
