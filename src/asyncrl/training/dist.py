"""torch.distributed set-up for the train ranks (world size 1 unless a launcher says more)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group() -> bool:
    """Join (or create) the default process group; True when this call created it.

    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the launcher (torchrun, the
    scheduler); without them this process is a world of one on a free loopback port.
    """
    if dist.is_initialized():
        return False
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and "MASTER_PORT" not in os.environ:
        raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_PORT is unset; launch the "
                           "train ranks with torchrun or set MASTER_ADDR/MASTER_PORT")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT") or str(free_port())
    # gloo also on GPU machines: CPU tensors (checkpoint metadata, gathered state dicts)
    # need a CPU backend next to NCCL.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size)
    return True


def local_device() -> torch.device:
    """This rank's accelerator, else the CPU.

    A scheduler that shows each rank only its own GPU (CUDA_VISIBLE_DEVICES=<one id>: our
    local launcher, Ray, Slurm) leaves one visible device, cuda:0; under torchrun on a
    node whose GPUs all show, the rank takes cuda:LOCAL_RANK."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", gpu_index(int(os.environ.get("LOCAL_RANK", "0")),
                                            torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def gpu_index(local_rank: int, visible: int) -> int:
    """The visible GPU of local rank `local_rank` when `visible` GPUs show: its own when each
    rank sees all of them, else the one it was given."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible "
                           "(CUDA_VISIBLE_DEVICES); give each rank one GPU or show it all")
    return local_rank
