"""One GPU for everything: colocated allocation_mode ('|'), memory shares, what cannot work,
and the command lines, environments and GPUs the servers and trainer ranks get."""

import json

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.allocation import Allocation, parse_allocation_mode
from asyncrl.config.schema import SchedulerConfig
from asyncrl.controller.launch import launch
from asyncrl.controller.specs import build_trainer_spec, run_paths
from asyncrl.launch.local import LocalScheduler, SchedulerError, _Proc


def _load(*overrides):
    return load_config(None, ["train_dataset.path=x", *overrides])


ONE_GPU = ("cluster.n_gpus_per_node=1",)


@pytest.mark.parametrize("mode, expected, gpus", [
    ("local:d1|fsdp:d1", Allocation("local", 1, 1, colocated=True), 1),
    (" vllm:d2 | d2 ", Allocation("vllm", 2, 2, colocated=True), 2),
    ("local:d1+fsdp:d1", Allocation("local", 1, 1, colocated=False), 2),
    ("sglang:d3+fsdp:d2", Allocation("sglang", 3, 2), 5),
])
def test_colocated_pairs_take_one_gpu_each_and_separate_parts_their_sum(mode, expected, gpus):
    alloc = parse_allocation_mode(mode)
    assert alloc == expected and alloc.n_gpus == gpus


@pytest.mark.parametrize("mode, message", [
    ("local:d2|fsdp:d1", r"both sides need as many \(here 2 for the servers and 1 for the "
                         r"ranks\); e.g. 'local:d1\|fsdp:d1', or '\+' for separate GPUs"),
    ("local:d1|fsdp:d1+x", r"one '\+' or '\|'"),
    ("local:d1||fsdp:d1", r"one '\+' or '\|'"),
])
def test_bad_colocated_modes_say_what_to_write(mode, message):
    with pytest.raises(ValueError, match=message):
        parse_allocation_mode(mode)


def test_one_gpu_colocated_run_resolves_to_one_server_one_rank_and_half_the_memory_each():
    cfg = _load("allocation_mode=local:d1|fsdp:d1", *ONE_GPU)
    assert cfg.colocated
    assert (cfg.rollout.backend, cfg.rollout.n_servers, cfg.trainer_world_size) == ("local", 1, 1)
    assert cfg.rollout.gpu_memory_fraction == 0.5
    cfg = _load("allocation_mode=vllm:d1|fsdp:d1", *ONE_GPU, "rollout.gpu_memory_fraction=0.3",
                "actor.weight_update_mode=ipc")
    assert cfg.rollout.gpu_memory_fraction == 0.3 and cfg.actor.weight_update_mode == "ipc"
    # Separate GPUs keep the backend's own default; a CPU machine shares everything anyway.
    assert _load("allocation_mode=vllm:d1+fsdp:d1", "cluster.n_gpus_per_node=2"
                 ).rollout.gpu_memory_fraction is None
    cpu = _load("allocation_mode=local:d1|fsdp:d1")
    assert not cpu.colocated and cpu.rollout.gpu_memory_fraction is None
    # Our server receives a broadcast over gloo (CPU memory): it may share the trainer's GPU.
    assert _load("allocation_mode=local:d1|fsdp:d1", *ONE_GPU,
                 "actor.weight_update_mode=broadcast").colocated


@pytest.mark.parametrize("overrides, message", [
    # two NCCL trainer ranks on one GPU
    (("allocation_mode=local:d2|fsdp:d2", *ONE_GPU),
     r"puts 2 trainer ranks on cluster.n_nodes x cluster.n_gpus_per_node = 1 GPU\(s\), and "
     r"NCCL refuses two ranks on one GPU; use at most d1 on both sides "
     r"\('local:d1\|fsdp:d1'\) or more GPUs"),
    # separate GPUs that are not there: the colocated form is named
    (("allocation_mode=local:d1+fsdp:d1", *ONE_GPU),
     r"needs 1 inference \+ 1 trainer GPUs but cluster.n_nodes x cluster.n_gpus_per_node = "
     r"1; to have servers and trainer ranks share 1 GPU\(s\), use 'local:d1\|fsdp:d1'"),
    (("allocation_mode=vllm:d1+fsdp:d2", "cluster.n_gpus_per_node=2"),
     r"needs 1 inference \+ 2 trainer GPUs .* use 'vllm:d2\|fsdp:d2'"),
    # vLLM's and SGLang's broadcast is NCCL from trainer rank 0 to server 0: one GPU
    (("allocation_mode=vllm:d1|fsdp:d1", *ONE_GPU, "actor.weight_update_mode=broadcast"),
     r"actor.weight_update_mode=broadcast with allocation_mode='vllm:d1\|fsdp:d1': vllm "
     r"receives the broadcast over NCCL, .* use actor.weight_update_mode=ipc or disk"),
    (("allocation_mode=sglang:d1|fsdp:d1", *ONE_GPU, "actor.weight_update_mode=broadcast"),
     r"sglang receives the broadcast over NCCL"),
    # CUDA IPC: a GPU, one colocated pair, a backend that takes it, the controller's client
    (("actor.weight_update_mode=ipc",),
     r"actor.weight_update_mode=ipc shares GPU memory by CUDA IPC, which a CPU machine "
     r"\(cluster.n_gpus_per_node=0\) has not; use actor.weight_update_mode=disk"),
    (("allocation_mode=local:d1+fsdp:d1", "cluster.n_gpus_per_node=2",
      "actor.weight_update_mode=ipc"),
     r"use allocation_mode='local:d1\|fsdp:d1' \(got 'local:d1\+fsdp:d1'\), or "
     r"actor.weight_update_mode=disk"),
    (("allocation_mode=local:d2|fsdp:d2", "cluster.n_gpus_per_node=2",
      "actor.weight_update_mode=ipc"), r"allocation_mode='local:d1\|fsdp:d1'"),
    (("allocation_mode=sglang:d1|fsdp:d1", *ONE_GPU, "actor.weight_update_mode=ipc"),
     r"the sglang backend has no IPC weight update here; use rollout.backend local or vllm"),
    (("allocation_mode=local:d1|fsdp:d1", *ONE_GPU, "actor.weight_update_mode=ipc",
      "scheduler.router=service"), r"set scheduler.router and scheduler.weight_update to inline"),
    # shares of memory
    (("rollout.gpu_memory_fraction=0.4",),
     r"rollout.gpu_memory_fraction=0.4 is for GPU servers but cluster.n_gpus_per_node=0"),
    (("allocation_mode=local:d1|fsdp:d1", *ONE_GPU, "rollout.gpu_memory_fraction=1.0"),
     r"rollout.gpu_memory_fraction must be in \(0, 1\) or null, got 1.0"),
    # sharing a GPU is the local scheduler's placement
    (("allocation_mode=local:d1|fsdp:d1", *ONE_GPU, "scheduler.type=ray"),
     r"which scheduler.type=local places \(not ray\); use scheduler.type=local, or '\+'"),
])
def test_what_cannot_work_on_the_gpus_is_an_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


# ---- what the scheduler starts ------------------------------------------------------------


class _Popen:
    pid = 0

    def poll(self):
        return None


class RecordingScheduler(LocalScheduler):
    """The local scheduler with its processes recorded instead of started."""

    def __init__(self, run_dir):
        super().__init__(SchedulerConfig(), run_dir)
        self.started = []  # (role, index, argv, environment)
        self.waited = {}  # role -> whether create_workers waited for its health

    def create_workers(self, spec, *, wait=True):
        self.waited[spec.role] = wait
        return super().create_workers(spec, wait=wait)

    def _spawn(self, spec, index, cores, env, port):
        values = {"host": "127.0.0.1", "port": str(port), "index": str(index),
                  "cpus": str(len(cores) or spec.cpus), "cores": ""}
        full = {**env, **spec.environment(values)}
        self.started.append((spec.role, index, spec.argv(index, values), full))
        worker = self._worker(spec.role, index, port)
        return _Proc(worker, _Popen(), cores, env)

    @staticmethod
    def _worker(role, index, port):
        from asyncrl.launch.base import Worker

        return Worker(role=role, index=index, host="127.0.0.1", port=port,
                      address=f"http://127.0.0.1:{port}", node_id="n", pid=0, log_path="")

    def _wait_healthy(self, procs):
        pass

    def pin_trainer(self, cores=None, *, shared=None):
        return 1

    def delete_workers(self, role=None, timeout=10.0):
        self.procs.clear()


def _started(tmp_path, tiny_path, *overrides, waited=None):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_path}",
                             "train_dataset.path=unused.jsonl", *overrides])
    scheduler = RecordingScheduler(tmp_path / "logs")
    launch(cfg, run_paths(cfg), scheduler)
    if waited is not None:
        waited.update(scheduler.waited)
    return {(role, i): (argv, env) for role, i, argv, env in scheduler.started}


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_colocated_server_and_trainer_rank_get_the_same_gpu(tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "allocation_mode=local:d1|fsdp:d1", *ONE_GPU,
                       "scheduler.trainer=service", "rollout.gpu_memory_fraction=0.35")
    argv, env = started["inference", 0]
    _, rank_env = started["trainer", 0]
    assert env["CUDA_VISIBLE_DEVICES"] == rank_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert _flag(argv, "--gpu-memory-fraction") == "0.35"
    assert (rank_env["RANK"], rank_env["WORLD_SIZE"]) == ("0", "1")


def test_separate_parts_take_gpus_one_after_the_other(tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "allocation_mode=local:d2+fsdp:d2",
                       "cluster.n_gpus_per_node=4")
    gpus = {key: env["CUDA_VISIBLE_DEVICES"] for key, (_, env) in started.items()}
    assert gpus == {("inference", 0): "2", ("inference", 1): "3", ("trainer", 0): "0",
                    ("trainer", 1): "1"}
    assert "--gpu-memory-fraction" not in started["inference", 0][0]


def test_two_colocated_pairs_on_two_gpus(tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "allocation_mode=local:d2|fsdp:d2",
                       "cluster.n_gpus_per_node=2")
    gpus = {key: env["CUDA_VISIBLE_DEVICES"] for key, (_, env) in started.items()}
    assert gpus == {("inference", 0): "0", ("inference", 1): "1", ("trainer", 0): "0",
                    ("trainer", 1): "1"}


def test_tensor_parallel_servers_take_t_gpus_each_after_the_trainer_mesh(tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "rollout.backend=vllm:d2t2",
                       "actor.backend=fsdp:d2t2", "cluster.n_gpus_per_node=8")
    gpus = {key: env["CUDA_VISIBLE_DEVICES"] for key, (_, env) in started.items()}
    assert gpus == {("inference", 0): "4,5", ("inference", 1): "6,7", ("trainer", 0): "0",
                    ("trainer", 1): "1", ("trainer", 2): "2", ("trainer", 3): "3"}
    assert _flag(started["inference", 1][0], "--tensor-parallel-size") == "2"
    assert started["trainer", 3][1]["WORLD_SIZE"] == "4"


def test_a_colocated_tensor_parallel_server_spans_the_ranks_gpus(tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "allocation_mode=sglang:d1t2|fsdp:d1t2",
                       "cluster.n_gpus_per_node=2")
    gpus = {key: env["CUDA_VISIBLE_DEVICES"] for key, (_, env) in started.items()}
    assert gpus == {("inference", 0): "0,1", ("trainer", 0): "0", ("trainer", 1): "1"}
    assert _flag(started["inference", 0][0], "--tp-size") == "2"


@pytest.mark.parametrize("backend, flag", [("vllm", "--gpu-memory-utilization"),
                                           ("sglang", "--mem-fraction-static")])
def test_each_backend_gets_the_memory_share_under_its_own_flag(tmp_path, tiny_path, backend,
                                                               flag):
    waited = {}
    started = _started(tmp_path, tiny_path, f"allocation_mode={backend}:d1|fsdp:d1", *ONE_GPU,
                       waited=waited)
    argv, env = started["inference", 0]
    assert _flag(argv, flag) == "0.5" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "--weight-transfer-config" not in argv  # disk: vLLM reloads from the folder
    # they size their cache from the memory free on start: up before the trainer loads
    assert waited == {"inference": True}


def test_our_colocated_server_starts_while_the_inline_trainer_loads(tmp_path, tiny_path):
    waited = {}
    _started(tmp_path, tiny_path, "allocation_mode=local:d1|fsdp:d1", *ONE_GPU, waited=waited)
    assert waited == {"inference": False}  # it sizes its cache from the GPU's total


def test_vllm_with_ipc_gets_its_ipc_weight_transfer_and_the_pickled_handles_allowed(
        tmp_path, tiny_path):
    started = _started(tmp_path, tiny_path, "allocation_mode=vllm:d1|fsdp:d1", *ONE_GPU,
                       "actor.weight_update_mode=ipc", "rollout.gpu_memory_fraction=0.4")
    argv, env = started["inference", 0]
    assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "ipc"}
    assert _flag(argv, "--gpu-memory-utilization") == "0.4"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "--enforce-eager" not in argv
    # the trainer is inline (one local rank): nothing else was started
    assert set(started) == {("inference", 0)}


def test_workers_see_the_gpus_this_process_sees_as_theirs(tmp_path, tiny_path, monkeypatch):
    # The inline trainer computes on this process's cuda:0 = physical GPU 3: so does the server.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    started = _started(tmp_path, tiny_path, "allocation_mode=local:d1|fsdp:d1", *ONE_GPU)
    assert started["inference", 0][1]["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")
    started = _started(tmp_path, tiny_path, "allocation_mode=local:d1+fsdp:d1",
                       "cluster.n_gpus_per_node=2", "scheduler.trainer=service")
    gpus = {key: env["CUDA_VISIBLE_DEVICES"] for key, (_, env) in started.items()}
    assert gpus == {("trainer", 0): "GPU-aa", ("inference", 0): "GPU-bb"}
    with pytest.raises(SchedulerError, match=r"GPUs \[1\] are not among this process's "
                                             r"CUDA_VISIBLE_DEVICES=3"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
        _started(tmp_path, tiny_path, "allocation_mode=local:d1+fsdp:d1",
                 "cluster.n_gpus_per_node=2")


def test_a_colocated_cuda_rank_caps_its_allocator_on_its_own_gpu(monkeypatch):
    """The trainer rank's share of the GPU is set for the config's device (its GPU), not
    from what the host has (the first run on a GPU found the call without a device)."""
    import torch

    from asyncrl.trainer import worker

    cfg = _load("allocation_mode=local:d1|fsdp:d1", *ONE_GPU, "rollout.gpu_memory_fraction=0.3")
    calls = []
    monkeypatch.setattr(worker, "local_device", lambda device: calls.append(device) or 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: calls.append((fraction, index)))

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(worker, "FSDPTrainEngine", stop)
    with pytest.raises(Loaded):
        worker.RLWorker(build_trainer_spec(cfg)).initialize(total_steps=1)
    assert calls == ["cuda", (pytest.approx(0.7), 0)]
