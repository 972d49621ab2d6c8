"""torch.distributed set-up for the train ranks (world size 1 unless a launcher says more)."""

from __future__ import annotations

import os
import socket
from typing import Literal

import torch
import torch.distributed as dist

from asyncrl.config.loader import ConfigError

Device = Literal["cpu", "cuda"]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: Device) -> bool:
    """Join (or create) the default process group of ranks on `device`; True when this call
    created it.

    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the launcher (torchrun, the
    scheduler); without them this process is a world of one on a free loopback port.
    """
    if dist.is_initialized():
        return False
    require_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and "MASTER_PORT" not in os.environ:
        raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_PORT is unset; launch the "
                           "train ranks with torchrun or set MASTER_ADDR/MASTER_PORT")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT") or str(free_port())
    backend = process_group_backend(device)
    dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size)
    return True


def process_group_backend(device: Device) -> str:
    """torch.distributed's backend for ranks on `device`.

    gloo also next to NCCL: CPU tensors (checkpoint metadata, gathered state dicts) need a
    CPU backend on GPU ranks too."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def require_device(device: Device) -> None:
    """Raise, naming the config key, unless this process can compute on `device`."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "cluster.n_gpus_per_node > 0 puts the trainer ranks on CUDA, but this process "
            f"sees no CUDA device (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'no'}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); set "
            "cluster.n_gpus_per_node=0 to train on the CPU, or install a CUDA build of torch")


def local_device(device: Device) -> torch.device:
    """This rank's device: the CPU, or its GPU when `device` is "cuda".

    `device` comes from the config (`cluster.n_gpus_per_node` > 0: "cuda"), never from what
    the host has: CPU ranks on a GPU host must not all take cuda:0. A scheduler that shows
    each rank only its own GPU (CUDA_VISIBLE_DEVICES=<one id>: our local launcher, Ray,
    Slurm) leaves one visible device, cuda:0; under torchrun on a node whose GPUs all show,
    the rank takes cuda:LOCAL_RANK."""
    require_device(device)
    if device == "cpu":
        return torch.device("cpu")
    index = gpu_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_index(local_rank: int, visible: int) -> int:
    """The visible GPU of local rank `local_rank` when `visible` GPUs show: its own when each
    rank sees all of them, else the one it was given."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible "
                           "(CUDA_VISIBLE_DEVICES); give each rank one GPU or show it all")
    return local_rank
