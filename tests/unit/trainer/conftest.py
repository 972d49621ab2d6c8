"""Every test starts from the default CPU speed paths and leaves them as it found them."""

import pytest

from asyncrl.trainer.cpu.options import CpuPaths, cpu_paths, set_cpu_paths


@pytest.fixture(autouse=True)
def default_cpu_paths():
    """Run each test under `CpuPaths()`; what a test sets with `set_cpu_paths` ends with it."""
    previous = cpu_paths()
    set_cpu_paths(CpuPaths())
    yield
    set_cpu_paths(previous)
