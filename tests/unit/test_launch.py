"""The command line and environment of each backend's server."""

import os
import sys

import pytest

from asyncrl.inference.backends import client_class
from asyncrl.inference.launch import server_command


def test_vllm_on_cpu_gets_eager_mode_dev_endpoints_and_processed_logprobs():
    argv, env = server_command("vllm", "/m", "127.0.0.1", 8001, dtype="float32",
                               extra=["--max-num-seqs", "4"])
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8001" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-num-seqs", "4"]
    assert argv[argv.index("--worker-extension-cls") + 1] == (
        "asyncrl.inference.vllm_worker.WeightSyncExtension")
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"  # no traffic off the machine
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpu_servers_get_their_devices_and_no_cpu_flags():
    argv, env = server_command("vllm", "/m", "127.0.0.1", 8001, device="cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and "--enforce-eager" not in argv
    argv, env = server_command("sglang", "/m", "127.0.0.1", 9000, device="cuda:0,1")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/m" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_local_server_command():
    argv, _ = server_command("local", "/m", "127.0.0.1", 7000, dtype="bfloat16")
    assert argv[1:3] == ["-m", "asyncrl.inference.server"]
    assert argv[argv.index("--model") + 1] == "/m" and argv[argv.index("--port") + 1] == "7000"


@pytest.mark.parametrize("backend, device, message", [
    ("trt", "cpu", "backend 'trt' is not one of"),
    ("vllm", "gpu", "device 'gpu' is not"),
])
def test_bad_backend_or_device_is_named(backend, device, message):
    with pytest.raises(ValueError, match=message):
        server_command(backend, "/m", "127.0.0.1", 1, device=device)


def test_each_backend_has_a_client_class():
    assert [client_class(b).backend for b in ("local", "vllm", "sglang")] == [
        "local", "vllm", "sglang"]
    with pytest.raises(ValueError, match="backend 'x' is not one of"):
        client_class("x")
