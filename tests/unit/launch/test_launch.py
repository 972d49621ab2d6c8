"""The command line and environment of each backend's server, and the inference role's spec."""

import os
import sys

import pytest

from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.client.backends import client_class
from asyncrl.launch.commands import inference_spec, server_command


def test_vllm_on_cpu_gets_eager_mode_dev_endpoints_and_processed_logprobs():
    argv, env = server_command("vllm", "/m", "127.0.0.1", 8001, dtype="float32",
                               extra=["--max-num-seqs", "4"])
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8001" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-num-seqs", "4"]
    # seeded requests need whole prefills on CPU (docs/guides/reliability.md)
    assert "--no-enable-chunked-prefill" in argv
    assert argv[argv.index("--worker-extension-cls") + 1] == (
        "asyncrl.inference.client.vllm_worker.WeightSyncExtension")
    assert "--enable-scale-out" in argv  # /inference/v1/generate: prompts with images
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"  # no traffic off the machine
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpu_servers_get_their_devices_and_no_cpu_flags():
    argv, env = server_command("vllm", "/m", "127.0.0.1", 8001, device="cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and "--enforce-eager" not in argv
    assert "--no-enable-chunked-prefill" not in argv  # a GPU generator rewinds
    argv, env = server_command("sglang", "/m", "127.0.0.1", 9000, device="cuda:0,1")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/m" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_local_server_command():
    argv, _ = server_command("local", "/m", "127.0.0.1", 7000, dtype="bfloat16")
    assert argv[1:3] == ["-m", "asyncrl.inference.server.app"]
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


def test_inference_spec_has_placeholders_and_a_seed_per_server():
    spec = inference_spec("local", "/m", LocalEngineConfig(max_batch_size=8), n_servers=2,
                          seed=10, cpus=3, extra_args=["--flag"])
    assert (spec.role, spec.count, spec.cpus, spec.gpus) == ("inference", 2, 3, 0)
    argv = spec.argv(1, {"host": "10.0.0.5", "port": "9001", "cpus": "3"})
    assert argv[argv.index("--host") + 1] == "10.0.0.5" and argv[argv.index("--port") + 1] == "9001"
    assert argv[argv.index("--threads") + 1] == "3" and argv[argv.index("--max-batch-size") + 1] == "8"
    assert argv[-3:] == ["--flag", "--seed", "11"]
    assert spec.env["HF_HUB_OFFLINE"] == "1" and "PATH" not in spec.env  # additions only


def test_vllm_spec_binds_its_engine_to_the_worker_host_and_cores():
    spec = inference_spec("vllm", "/m", LocalEngineConfig(), n_servers=1, seed=0,
                          cache_dir="/run/vllm-cache")
    env = spec.environment({"host": "10.0.0.5", "cores": "4,5"})
    assert env["VLLM_HOST_IP"] == os.environ.get("VLLM_HOST_IP", "10.0.0.5")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "4,5")
    assert env["VLLM_CACHE_ROOT"] == os.environ.get("VLLM_CACHE_ROOT", "/run/vllm-cache")
    gpu = inference_spec("sglang", "/m", LocalEngineConfig(), n_servers=2, seed=0, device="cuda")
    assert gpu.gpus == 1 and gpu.worker_args == [["--random-seed", "0"], ["--random-seed", "1"]]


@pytest.mark.parametrize("backend, flag", [("vllm", "--tensor-parallel-size"),
                                           ("sglang", "--tp-size")])
def test_tensor_parallel_servers_get_their_flag_and_that_many_gpus(backend, flag):
    spec = inference_spec(backend, "/m", LocalEngineConfig(), n_servers=2, seed=0,
                          device="cuda", tensor_parallel_size=4)
    argv = spec.argv(0, {"host": "h", "port": "1", "cpus": "1"})
    assert argv[argv.index(flag) + 1] == "4" and spec.gpus == 4
    one = inference_spec(backend, "/m", LocalEngineConfig(), n_servers=1, seed=0, device="cuda")
    assert flag not in one.argv(0, {"host": "h", "port": "1", "cpus": "1"})


def test_tensor_parallel_is_refused_for_our_engine_and_on_the_cpu():
    with pytest.raises(ValueError, match="our local engine runs each server on one device"):
        inference_spec("local", "/m", LocalEngineConfig(), n_servers=1, seed=0, device="cuda",
                       tensor_parallel_size=2)
    with pytest.raises(ValueError, match="but device is 'cpu'"):
        inference_spec("vllm", "/m", LocalEngineConfig(), n_servers=1, seed=0,
                       tensor_parallel_size=2)


def test_expert_parallel_servers_get_vllms_switch_or_sglangs_size():
    argv = {}
    for backend, t, e in (("vllm", 2, 2), ("sglang", 4, 2)):
        spec = inference_spec(backend, "/m", LocalEngineConfig(), n_servers=1, seed=0,
                              device="cuda", tensor_parallel_size=t, expert_parallel_size=e)
        argv[backend] = spec.argv(0, {"host": "h", "port": "1", "cpus": "1"})
        assert spec.gpus == t  # the experts are split among the server's own GPUs
    vllm, sglang = argv["vllm"], argv["sglang"]
    assert "--enable-expert-parallel" in vllm and "--ep-size" not in vllm
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "2"
    assert sglang[sglang.index("--ep-size") + 1] == "2"
    assert sglang[sglang.index("--tp-size") + 1] == "4"
    assert "--enable-expert-parallel" not in sglang
    with pytest.raises(ValueError, match="vLLM splits the experts over all "
                                         "tensor_parallel_size=4 GPUs"):
        inference_spec("vllm", "/m", LocalEngineConfig(), n_servers=1, seed=0, device="cuda",
                       tensor_parallel_size=4, expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size=3 must be >= 1 and divide "
                                         "tensor_parallel_size=4"):
        inference_spec("sglang", "/m", LocalEngineConfig(), n_servers=1, seed=0,
                       device="cuda", tensor_parallel_size=4, expert_parallel_size=3)


def test_lora_servers_start_ready_to_load_adapters_of_the_runs_rank():
    from asyncrl.launch.commands import LoraServing

    def argv_env(backend, lora):
        spec = inference_spec(backend, "/m", LocalEngineConfig(), n_servers=1, seed=0, lora=lora)
        return spec.argv(0, {"host": "h", "port": "1", "cpus": "1"}), spec.env

    # vLLM takes one of its fixed ranks (1, 8, 16, 32, ...): the smallest that holds r = 12
    argv, env = argv_env("vllm", LoraServing(12))
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "16"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"  # the load/unload routes
    argv, _ = argv_env("sglang", LoraServing(12, ("q_proj", "v_proj")))
    assert argv[argv.index("--max-lora-rank") + 1] == "12"
    targets = argv.index("--lora-target-modules") + 1
    assert argv[targets:targets + 3] == ["q_proj", "v_proj", "--random-seed"]
    argv, _ = argv_env("sglang", LoraServing(8))
    assert argv[argv.index("--lora-target-modules") + 1] == "all"
    argv, env = argv_env("local", LoraServing(8))  # our engine merges each folder itself
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert "--enable-lora" not in argv_env("vllm", None)[0]
    with pytest.raises(ValueError, match="actor.lora_rank=600: vLLM serves ranks up to 512"):
        argv_env("vllm", LoraServing(600))
