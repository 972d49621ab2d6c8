import dataclasses

import pytest

from asyncrl.trainer.cpu import logprob_head
from asyncrl.trainer.cpu.options import CpuPaths, cpu_paths, set_cpu_paths, use_cpu_paths


def test_defaults_turn_every_path_on_but_fsdp_on_one_rank():
    fields = {f.name: f.default for f in dataclasses.fields(CpuPaths)}
    assert len(fields) == 15
    assert fields.pop("fsdp_on_one_rank") is False
    assert all(v is True for v in fields.values()), fields


def test_use_cpu_paths_changes_one_field_and_restores_the_previous_paths():
    before = cpu_paths()
    with use_cpu_paths(keep_spare_templates=False) as inside:
        assert cpu_paths() is inside
        assert inside == dataclasses.replace(before, keep_spare_templates=False)
        with use_cpu_paths(CpuPaths(norm_kernels=False)):
            assert cpu_paths() == CpuPaths(norm_kernels=False)
        assert cpu_paths() is inside
    assert cpu_paths() is before


def test_use_cpu_paths_restores_after_an_exception():
    before = cpu_paths()
    with pytest.raises(RuntimeError), use_cpu_paths(grad_kernels=False):
        raise RuntimeError("inside")
    assert cpu_paths() is before


def test_the_paths_read_the_current_options():
    import torch
    hidden = torch.zeros(2, 3, dtype=torch.bfloat16)
    weight = torch.zeros(5, 3, dtype=torch.bfloat16)
    with use_cpu_paths(logprob_kernels=False):
        assert not logprob_head._use_kernels(hidden, weight)
    assert logprob_head._use_kernels(hidden, weight) == (logprob_head._kernels() is not None)


def test_bad_options_are_rejected_with_their_name():
    with pytest.raises(TypeError, match="CpuPaths"):
        set_cpu_paths({"norm_kernels": False})
    with pytest.raises(TypeError, match="no_such_path"):
        set_cpu_paths(no_such_path=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu_paths().norm_kernels = False
