"""allocation_mode strings, and how they set rollout.backend and rollout.n_servers."""

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.allocation import Allocation, parse_allocation_mode


@pytest.mark.parametrize("mode, expected", [
    ("vllm:d2+fsdp:d1", Allocation("vllm", 2, 1)),
    ("sglang:d4+fsdp:d4", Allocation("sglang", 4, 4)),
    ("local:d1+fsdp:d1", Allocation("local", 1, 1)),
    ("vllm:d3t1p1+d2", Allocation("vllm", 3, 2)),  # t1/p1 and a bare d<M> are accepted
    (" sglang:d8 + fsdp:d16 ", Allocation("sglang", 8, 16)),
])
def test_good_allocation_modes_parse(mode, expected):
    assert parse_allocation_mode(mode) == expected


@pytest.mark.parametrize("mode, message", [
    ("vllm:d2", "one '\\+'"),
    ("vllm:d2+fsdp:d1+x", "one '\\+'"),
    ("trt:d2+fsdp:d1", "backend 'trt' is not one of"),
    ("vllm:2+fsdp:d1", "inference part 'vllm:2'"),
    ("vllm:d2t2+fsdp:d1", "tensor parallel inference \\(t2\\) is not supported"),
    ("vllm:d2p4+fsdp:d1", "pipeline parallel inference \\(p4\\) is not supported"),
    ("vllm:d2+megatron:d1", "training engine 'megatron' is not supported"),
    ("vllm:d2+fsdp:x1", "training part 'fsdp:x1'"),
    ("vllm:d0+fsdp:d1", "d must be >= 1"),
])
def test_bad_allocation_modes_name_the_bad_part(mode, message):
    with pytest.raises(ValueError, match=message):
        parse_allocation_mode(mode)


def _load(*overrides):
    return load_config(None, ["train_dataset.path=x", *overrides])


def test_allocation_mode_sets_backend_servers_and_trainer_world():
    cfg = _load("allocation_mode=sglang:d4+fsdp:d2")
    assert (cfg.rollout.backend, cfg.rollout.n_servers, cfg.trainer_world_size) == ("sglang", 4, 2)


def test_without_allocation_mode_the_defaults_are_one_local_server():
    cfg = _load()
    assert (cfg.rollout.backend, cfg.rollout.n_servers, cfg.trainer_world_size) == ("local", 1, 1)
    cfg = _load("rollout.backend=vllm", "rollout.n_servers=3")
    assert (cfg.rollout.backend, cfg.rollout.n_servers) == ("vllm", 3)


def test_rollout_fields_may_repeat_allocation_mode_but_not_contradict_it():
    cfg = _load("allocation_mode=vllm:d2+fsdp:d1", "rollout.backend=vllm", "rollout.n_servers=2")
    assert cfg.rollout.n_servers == 2
    with pytest.raises(ConfigError, match="rollout.n_servers=3 contradicts allocation_mode"):
        _load("allocation_mode=vllm:d2+fsdp:d1", "rollout.n_servers=3")
    with pytest.raises(ConfigError, match="rollout.backend=local contradicts"):
        _load("allocation_mode=vllm:d2+fsdp:d1", "rollout.backend=local")
    with pytest.raises(ConfigError, match="inference part"):
        _load("allocation_mode=vllm+fsdp:d1")


def test_allocation_mode_must_fit_the_gpus_of_the_cluster():
    cfg = _load("allocation_mode=vllm:d2+fsdp:d2", "cluster.n_gpus_per_node=4")
    assert cfg.trainer_world_size == 2
    with pytest.raises(ConfigError, match="needs 2 inference \\+ 4 trainer GPUs but "
                                          "cluster.n_nodes x cluster.n_gpus_per_node = 4"):
        _load("allocation_mode=vllm:d2+fsdp:d4", "cluster.n_gpus_per_node=4")
    # Two nodes of 4 GPUs hold 2 + 4 (under a multi-node scheduler).
    cfg = _load("allocation_mode=vllm:d2+fsdp:d4", "cluster.n_gpus_per_node=4",
                "cluster.n_nodes=2", "scheduler.type=ray")
    assert (cfg.rollout.n_servers, cfg.trainer_world_size) == (2, 4)
    with pytest.raises(ConfigError, match="scheduler.type=local runs on one machine"):
        _load("cluster.n_nodes=2")
