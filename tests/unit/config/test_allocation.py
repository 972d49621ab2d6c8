"""allocation_mode strings and AReaL's per-engine spelling (rollout.backend: vllm:d2t4,
actor.backend: fsdp:d2t2), and how they set rollout.backend, n_servers and the trainer mesh."""

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.allocation import Allocation, parse_allocation_mode


@pytest.mark.parametrize("mode, expected", [
    ("vllm:d2+fsdp:d1", Allocation("vllm", 2, 1)),
    ("sglang:d4+fsdp:d4", Allocation("sglang", 4, 4)),
    ("local:d1+fsdp:d1", Allocation("local", 1, 1)),
    ("vllm:d3t1p1+d2", Allocation("vllm", 3, 2)),  # t1/p1 and a bare d<M> are accepted
    (" sglang:d8 + fsdp:d16 ", Allocation("sglang", 8, 16)),
    # 2 servers of 4 GPUs; 2 x 2 trainer ranks (d2 data groups of t2 tensor ranks)
    ("vllm:d2t4+fsdp:d2t2", Allocation("vllm", 2, 4, False, 4, 2)),
    ("sglang:t2d1+fsdp:t4d1", Allocation("sglang", 1, 4, False, 2, 4)),  # any order
    ("vllm:d1t2|fsdp:d1t2", Allocation("vllm", 1, 2, True, 2, 2)),  # the same 2 GPUs
    ("vllm:d2t2|fsdp:d4", Allocation("vllm", 2, 4, True, 2, 1)),
    # d2 data groups of e2 expert ranks: 4 trainer ranks, each expert held by 2 of them
    ("local:d1+fsdp:d2e2", Allocation("local", 1, 4, False, 1, 1, 1, 2)),
    ("sglang:d1t4e2+fsdp:e2d1", Allocation("sglang", 1, 2, False, 4, 1, 2, 2)),
    ("vllm:d2t2e2+fsdp:d1", Allocation("vllm", 2, 1, False, 2, 1, 2, 1)),
])
def test_good_allocation_modes_parse(mode, expected):
    assert parse_allocation_mode(mode) == expected


@pytest.mark.parametrize("mode, message", [
    ("vllm:d2", "one '\\+'"),
    ("vllm:d2+fsdp:d1+x", "one '\\+'"),
    ("trt:d2+fsdp:d1", "backend 'trt' is not one of"),
    ("vllm:2+fsdp:d1", "inference part 'vllm:2'"),
    ("vllm:d2p4+fsdp:d1", "pipeline parallelism \\(p4\\) is not supported"),
    ("vllm:d2t2t2+fsdp:d1", "gives t more than once"),
    ("vllm:t2+fsdp:d1", "has no d<N>"),
    ("vllm:d2+fsdp:d1t0", "t must be >= 1"),
    ("vllm:d2t2|fsdp:d2", "here 4 for the servers and 2 for the ranks"),
    ("vllm:d2+megatron:d1", "training engine 'megatron' is not supported"),
    ("vllm:d2+fsdp:x1", "training part 'fsdp:x1'"),
    ("vllm:d0+fsdp:d1", "d must be >= 1"),
    ("vllm:d2+fsdp:d1t2e2", "tensor \\(t2\\) and expert \\(e2\\) parallel training together "
                            "are not supported; use one of them, e.g. 'fsdp:d1e2'"),
    ("local:d1t1e2+fsdp:d1", "our local engine runs a Mixture-of-Experts model in one process"),
    ("vllm:d1t4e2+fsdp:d1", "vLLM's expert parallelism splits the experts over all the "
                            "server's t4 tensor-parallel GPUs; use e4"),
    ("sglang:d1t4e3+fsdp:d1", "e must divide t"),
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


def test_canonical_spellings_read_back_as_the_same_allocation():
    alloc = parse_allocation_mode("vllm:t4d2 + d2t2")
    assert (alloc.mode, alloc.rollout_part, alloc.train_part) == (
        "vllm:d2t4+fsdp:d2t2", "vllm:d2t4", "fsdp:d2t2")
    assert parse_allocation_mode(alloc.mode) == alloc
    assert (alloc.n_gpus, alloc.server_gpus, alloc.trainer_data_size) == (12, 8, 2)


def test_per_engine_backends_set_the_same_layout_as_allocation_mode():
    gpus = ("cluster.n_gpus_per_node=8", "cluster.n_nodes=2", "scheduler.type=ray")
    whole = _load("allocation_mode=vllm:d2t4+fsdp:d2t2", *gpus)
    split = _load("rollout.backend=vllm:d2t4", "actor.backend=fsdp:d2t2", *gpus)
    for cfg in (whole, split):
        assert (cfg.allocation_mode, cfg.rollout.backend, cfg.rollout.n_servers,
                cfg.actor.backend) == ("vllm:d2t4+fsdp:d2t2", "vllm", 2, "fsdp:d2t2")
        assert (cfg.trainer_world_size, cfg.server_tensor_size) == (4, 4)
    # Each key alone: the other side keeps its default (one local server, one rank).
    cfg = _load("actor.backend=fsdp:d1t2")
    assert (cfg.allocation_mode, cfg.trainer_world_size) == ("local:d1+fsdp:d1t2", 2)
    cfg = _load("rollout.backend=sglang:d3")
    assert (cfg.allocation_mode, cfg.rollout.n_servers) == ("sglang:d3+fsdp:d1", 3)
    # Repeating allocation_mode is fine; so is loading a resolved config again.
    cfg = _load("allocation_mode=vllm:d2t4+fsdp:d2t2", "rollout.backend=vllm:d2t4",
                "actor.backend=fsdp:d2t2", "rollout.n_servers=2", *gpus)
    assert cfg.trainer_world_size == 4


def test_expert_parallel_layouts_read_back_and_agree_between_spellings():
    alloc = parse_allocation_mode("sglang:e2t4d1 + e2d2")
    assert (alloc.mode, alloc.rollout_part, alloc.train_part) == (
        "sglang:d1t4e2+fsdp:d2e2", "sglang:d1t4e2", "fsdp:d2e2")
    assert parse_allocation_mode(alloc.mode) == alloc
    # 4 server GPUs (the experts split over 2 of them) and 2 x 2 trainer ranks
    assert (alloc.n_gpus, alloc.server_gpus, alloc.trainer_data_size) == (8, 4, 2)
    gpus = ("cluster.n_gpus_per_node=8",)
    split = _load("rollout.backend=sglang:d1t4e2", "actor.backend=fsdp:d2e2", *gpus)
    assert (split.allocation_mode, split.trainer_world_size, split.server_expert_size) == (
        "sglang:d1t4e2+fsdp:d2e2", 4, 2)
    with pytest.raises(ConfigError, match="actor.backend='fsdp:d4' contradicts allocation_mode"):
        _load("allocation_mode=sglang:d1t4e2+fsdp:d2e2", "actor.backend=fsdp:d4", *gpus)
    with pytest.raises(ConfigError, match="rollout.backend='sglang:d1t4' contradicts"):
        _load("allocation_mode=sglang:d1t4e2+fsdp:d2e2", "rollout.backend=sglang:d1t4", *gpus)


@pytest.mark.parametrize("overrides, message", [
    (["allocation_mode=vllm:d2+fsdp:d4", "actor.backend=fsdp:d2t2"],
     "actor.backend='fsdp:d2t2' contradicts allocation_mode='vllm:d2\\+fsdp:d4' "
     "\\(training part fsdp:d4\\)"),
    (["allocation_mode=vllm:d2+fsdp:d4", "rollout.backend=vllm:d2t2"],
     "rollout.backend='vllm:d2t2' contradicts allocation_mode='vllm:d2\\+fsdp:d4' "
     "\\(inference part vllm:d2\\)"),
    (["allocation_mode=vllm:d2+fsdp:d4", "rollout.backend=sglang:d2"],
     "rollout.backend=sglang:d2 contradicts allocation_mode"),
    (["rollout.backend=vllm:d2", "rollout.n_servers=3"],
     "rollout.n_servers=3 contradicts rollout.backend='vllm:d2'"),
    (["actor.backend=megatron:d2"], "actor.backend='megatron:d2': training engine 'megatron'"),
    (["actor.backend=fsdp:2"], "actor.backend='fsdp:2': '2' is not a layout"),
    (["rollout.backend=trt:d2"], "rollout.backend='trt:d2': backend 'trt' is not one of"),
])
def test_layout_keys_that_disagree_or_are_malformed_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_inference_tensor_parallel_needs_gpus_and_a_backend_that_splits_a_model():
    with pytest.raises(ConfigError, match="our local engine runs each server on one device"):
        _load("rollout.backend=local:d1t2", "cluster.n_gpus_per_node=4")
    with pytest.raises(ConfigError, match="cluster.n_gpus_per_node=0 \\(a CPU machine\\)"):
        _load("rollout.backend=vllm:d1t2")
    with pytest.raises(ConfigError, match="one rank per server, but each server .* is 2 "
                                          "tensor-parallel workers; use actor.weight_update_"
                                          "mode=disk"):
        _load("rollout.backend=vllm:d1t2", "cluster.n_gpus_per_node=4",
              "actor.weight_update_mode=broadcast")
    # Training tensor parallelism runs on the CPU (gloo), but not with the trie attention.
    assert _load("actor.backend=fsdp:d2t2").trainer_world_size == 4
    with pytest.raises(ConfigError, match="actor.shared_prefix=true .* set "
                                          "actor.shared_prefix=false"):
        _load("actor.backend=fsdp:d1t2", "actor.shared_prefix=true")


def test_tensor_parallel_layouts_count_every_gpu_of_the_cluster():
    cfg = _load("allocation_mode=vllm:d1t4+fsdp:d2t2", "cluster.n_gpus_per_node=8")
    assert cfg.trainer_world_size == 4
    with pytest.raises(ConfigError, match="needs 8 inference \\+ 4 trainer GPUs but "
                                          "cluster.n_nodes x cluster.n_gpus_per_node = 8"):
        _load("allocation_mode=vllm:d2t4+fsdp:d2t2", "cluster.n_gpus_per_node=8")
    # Colocated: the servers' 2 x 2 GPUs are the trainer's 4 ranks' GPUs.
    cfg = _load("allocation_mode=vllm:d2t2|fsdp:d2t2", "cluster.n_gpus_per_node=4")
    assert cfg.colocated and cfg.rollout.gpu_memory_fraction == 0.5
