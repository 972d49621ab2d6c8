"""The trainer ranks' device and process-group backend follow cluster.n_gpus_per_node.

What the host has must not decide it: CPU ranks on a GPU host would all take cuda:0 (and
NCCL refuses two ranks on one GPU). Here `torch.cuda.is_available` is patched to say a GPU
shows, and the ranks must still stay on the CPU with gloo.
"""

import pytest
import torch
import torch.distributed as dist

from asyncrl.config import ConfigError, load_config
from asyncrl.config.offline import SFTConfig
from asyncrl.controller.specs import build_trainer_spec
from asyncrl.models.tiny import make_tiny_model
from asyncrl.offline.loop import OfflineTrainer
from asyncrl.trainer.dist import local_device, process_group_backend
from asyncrl.trainer.worker import RLWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def cuda_shows(monkeypatch):
    """A host where torch reports one GPU (this CPU build has none to use)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def rl_config(tmp_path, model, gpus):
    return load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={model}",
                              "actor.dtype=float32", "train_dataset.path=unused.jsonl",
                              f"cluster.n_gpus_per_node={gpus}"])


def sft_config(tmp_path, model, gpus):
    return load_config(None, [f"cluster.fileroot={tmp_path}", f"model.path={model}",
                              "train_dataset.path=unused.jsonl",
                              f"cluster.n_gpus_per_node={gpus}"], schema=SFTConfig)


def test_backend_is_gloo_on_cpu_and_gloo_beside_nccl_on_cuda():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"


def test_rl_rank_without_configured_gpus_stays_on_cpu_when_a_gpu_shows(tmp_path, tiny,
                                                                        cuda_shows):
    assert not dist.is_initialized()
    worker = RLWorker(build_trainer_spec(rl_config(tmp_path, tiny, gpus=0)))
    try:
        assert worker.initialize(total_steps=1) == {"rank": 0, "world_size": 1}
        assert worker.actor.device == torch.device("cpu")
        assert {p.device.type for p in worker.actor.model.parameters()} == {"cpu"}
        assert dist.get_backend() == "gloo"
    finally:
        worker.destroy()
    assert not dist.is_initialized()


def test_offline_trainer_without_configured_gpus_makes_a_gloo_group_when_a_gpu_shows(
        tmp_path, tiny, cuda_shows):
    with OfflineTrainer(sft_config(tmp_path, tiny, gpus=0)) as trainer:
        assert trainer.cfg.model.engine_spec(device=trainer.cfg.cluster.device).device == "cpu"
        assert dist.get_backend() == "gloo"
    assert not dist.is_initialized()


def test_rl_rank_asked_for_cuda_without_cuda_names_the_key(tmp_path, tiny, no_cuda):
    worker = RLWorker(build_trainer_spec(rl_config(tmp_path, tiny, gpus=1)))
    with pytest.raises(ConfigError, match=r"cluster\.n_gpus_per_node > 0 puts the trainer ranks "
                                          r"on CUDA, but this process sees no CUDA device.*"
                                          r"set cluster\.n_gpus_per_node=0"):
        worker.initialize(total_steps=1)
    assert not dist.is_initialized()  # refused before any process group was made


def test_offline_trainer_asked_for_cuda_without_cuda_names_the_key(tmp_path, tiny, no_cuda):
    with pytest.raises(ConfigError, match=r"cluster\.n_gpus_per_node > 0"):
        OfflineTrainer(sft_config(tmp_path, tiny, gpus=1))
    assert not dist.is_initialized()


def test_local_device_on_cpu_ignores_a_visible_gpu(cuda_shows):
    assert local_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'gpu'"):
        local_device("gpu")
