"""Freed memory kept for reuse: glibc's settings (trainer/cpu/heap.py) and the fp32 gradient
buffers of the one-rank compute copies (trainer/cpu/precision.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from asyncrl.trainer.cpu.precision import ComputeWeights

# Two rounds of 24 blocks of 8 MiB, written and freed in reverse; prints the page faults of
# the second round (counted by the kernel, not by us).
ROUNDS = """
import ctypes, resource, sys
sys.path[:0] = {path!r}
if {keep}:
    from asyncrl.trainer.cpu.heap import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def round_():
    blocks = [libc.malloc(8 << 20) for _ in range(24)]
    for b in blocks:
        ctypes.memset(b, 1, 8 << 20)
    for b in reversed(blocks):
        libc.free(b)

round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_round_faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS.format(path=sys.path, keep=keep)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_blocks_are_reused_without_page_faults():
    # 192 MiB freed at the heap's top: glibc's default trims it (its threshold follows the
    # 8 MiB blocks to 16 MiB), so the second round takes every page again: 24 * 2048 faults
    # of 4 KiB. Kept, the second round writes the same pages.
    pages = 24 * (8 << 20) // 4096
    assert second_round_faults(keep=False) > 0.9 * pages
    assert second_round_faults(keep=True) < 0.05 * pages


def test_compute_copies_reuse_their_fp32_gradient_buffers():
    # Each backward's bf16 gradient lands in the same fp32 buffer from step to step, equal
    # to the bf16 gradient of a plain bf16 copy of the model cast to fp32.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).bfloat16()
    weights = ComputeWeights(model, torch.bfloat16)
    pointers = []
    for step in range(3):
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            for p, q in zip(reference.parameters(), model.parameters()):
                p.copy_(q)
        with weights.active():
            model(x).square().sum().backward()
        reference.zero_grad(set_to_none=True)
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, q.grad.float())
        pointers.append([p.grad.data_ptr() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        model.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
    assert pointers[0] == pointers[1] == pointers[2]
