"""Fixtures of the train-engine tests: a process group per module, a tiny model on disk;
the device of the `device`-marked tests."""

import os

import pytest
import torch
import torch.distributed as dist

from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer.dist import init_process_group


@pytest.fixture(scope="module")
def process_group():
    """One process group for the module, so that engines come and go without owning it."""
    torch.set_num_threads(1)
    created = init_process_group("cpu")
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# $ASYNCRL_TEST_DEVICE, else the CPU and the simulated accelerator of `device_check.py`
# (there a tensor the path forgot to put on the device raises DeviceLeak).
_DEVICES = [os.environ["ASYNCRL_TEST_DEVICE"]] if os.environ.get("ASYNCRL_TEST_DEVICE") else [
    "cpu", "simulated"]


@pytest.fixture(params=_DEVICES)
def test_device(request):
    """The device `device`-marked tests compute on (their references are fp32 on the CPU).

    ASYNCRL_TEST_DEVICE=cuda pytest -m device runs them on a GPU; unset, they run on the CPU
    and on the simulated accelerator."""
    name = request.param
    if name == "simulated":
        from device_check import simulated_device

        with simulated_device() as device:
            yield device
        return
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"ASYNCRL_TEST_DEVICE={name!r} is not a torch device ({e}); "
                                "use cpu, cuda or simulated") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"ASYNCRL_TEST_DEVICE={name!r} but torch sees no CUDA device; "
                                "unset it to test on the CPU")
    if device.type == "cuda" and device.index is None:  # as tensors report it: cuda:0
        device = torch.device("cuda", torch.cuda.current_device())
    yield device
