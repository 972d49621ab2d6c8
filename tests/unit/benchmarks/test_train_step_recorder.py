"""benchmarks/train_step.py's record of a step's matrix products (its MFU bound rests on it)."""

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import train_step


def test_the_recorder_sees_forward_and_backward_products_with_their_flops():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    recorder = train_step.MatmulRecorder()
    with recorder:
        F.linear(x, w).sum().backward()  # x w^T, then grad w and grad x^T x
        torch.bmm(a, b)
        torch.add(a, 1.0)  # not a product: not recorded
    assert sum(recorder.calls.values()) == 4
    flops = sum(train_step.matmul_flops(sig[0], sig[1]) * n for sig, n in recorder.calls.items())
    # three products of 8 x 16 x 32 (forward, input gradient, weight gradient), one 2 x 3x4x5
    assert flops == 3 * 2 * 8 * 16 * 32 + 2 * 2 * 3 * 4 * 5
    assert recorder.seconds > 0
    layouts = {tuple(o[2] for o in sig[1]) for sig in recorder.calls}
    assert ((16, 1), (1, 16)) in layouts  # the forward reads w transposed, and is timed so
    for sig in recorder.calls:
        assert train_step.alone_seconds(sig, repeats=2) > 0
