"""Which CPU speed paths of the trainer are on: one frozen options object, read by the paths
through `cpu_paths()`; tests and benchmarks switch paths with `use_cpu_paths(...)`.

Every path is on by default except `fsdp_on_one_rank`; each off position is the slower
reference the path is checked against (the same numbers, or those of FSDP2 bit for bit)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuPaths:
    """One bool per CPU speed path; the defaults are what the trainer runs."""

    # C kernel for the chunked log-prob head (off: the torch path). Default on.
    logprob_kernels: bool = True
    # A freed CPU buffer of gradient templates kept for the next log-prob call (off: a fresh
    # one per call). Default on.
    keep_spare_templates: bool = True
    # C kernel for RMSNorm (off: HF's forward). Default on.
    norm_kernels: bool = True
    # C kernel for SwiGLU MLPs (off: HF's forward). Default on.
    mlp_kernels: bool = True
    # C kernel for the rotary embedding (off: HF's apply_rotary_pos_emb). Default on.
    rope_kernels: bool = True
    # C kernels for gradient passes: widening adds, transposes, norms (off: torch). Default on.
    grad_kernels: bool = True
    # The matmul trie attention (off: SDPA's flash). Default on.
    matmul_attention: bool = True
    # On the matmul attention path, q, k, v and the output moved between nodes and rows in C
    # (off: torch's index_copy/index_select around transposing copies; the same numbers).
    # Default on.
    attention_moves_in_c: bool = True
    # Linears with contiguous operands for their backward matmuls (off: autograd's linear).
    # Default on.
    contiguous_linear: bool = True
    # Gradients of the tied embedding straight into the fp32 master (off: through autograd,
    # the numbers of FSDP2 bit for bit). Default on.
    grads_to_master: bool = True
    # CopyingAdamW writes the bf16 compute copies inside the step (off: torch's fused AdamW
    # and a cast of the copies at the next forward, the numbers of FSDP2 bit for bit).
    # Default on.
    write_copies_in_step: bool = True
    # malloc keeps freed memory (no trimming, no mmap for large blocks) once
    # FSDPTrainEngine.initialize runs on the CPU (off: glibc's defaults). Default on.
    keep_freed_memory: bool = True
    # Clip by the fused AdamW's gradient scale instead of a pass multiplying every gradient
    # first (~50 ms of a quickstart-shaped step at one thread); plain tensors only. Off:
    # clip_grads_with_norm_, the same update up to a rounding of the scaled gradient.
    # Default on.
    clip_in_optimizer: bool = True
    # The global gradient norm in one parallel pass in C where it applies (plain fp32 CPU
    # gradients; off: torch's get_total_norm, which rounds its sums otherwise). Default on.
    norm_in_c: bool = True
    # FSDP2 also on one rank (tests compare the two paths; on one rank it only adds copies).
    # Default off.
    fsdp_on_one_rank: bool = False


_current = CpuPaths()


def cpu_paths() -> CpuPaths:
    """The CPU speed paths now in force."""
    return _current


def set_cpu_paths(paths: CpuPaths | None = None, **changes: bool) -> CpuPaths:
    """Put `paths` (default: the current ones), with the fields in `changes` replaced, in
    force until the next call (a benchmark's A/B arm); returns what is now in force."""
    global _current
    if paths is not None and not isinstance(paths, CpuPaths):
        raise TypeError(f"set_cpu_paths takes a CpuPaths, got {type(paths).__name__}")
    base = paths if paths is not None else _current
    _current = dataclasses.replace(base, **changes) if changes else base
    return _current


@contextlib.contextmanager
def use_cpu_paths(paths: CpuPaths | None = None, **changes: bool) -> Iterator[CpuPaths]:
    """Put `paths` (default: the current ones), with `changes` applied, in force inside the
    block; the previous paths come back on exit."""
    previous = _current
    try:
        yield set_cpu_paths(paths, **changes)
    finally:
        set_cpu_paths(previous)
