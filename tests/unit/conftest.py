"""Fixtures of the train-engine tests: a process group per module, a tiny model on disk."""

import pytest
import torch
import torch.distributed as dist

from asyncrl.models.tiny import make_tiny_model
from asyncrl.training.dist import init_process_group


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
