"""Freed memory kept for the next step (glibc's malloc, CPU training).

A training step allocates and frees the same large buffers every step: activations,
logit chunks, gradients. glibc serves a block above its mmap threshold (128 KiB at
start, rising with what is freed, up to 32 MiB) from a fresh mapping that it unmaps on
free, and it hands the heap's free top back to the kernel past its trim threshold. The
next step then takes every page of those buffers again as a page fault, which the kernel
zeroes first. On the quickstart's step that was ~370k minor faults (1.4 GB) per step and
~15% of the step's time (`benchmarks/train_step.py`, "heap kept").

`keep_freed_memory()` fixes the threshold at 32 MiB, so blocks up to that size come from
the heap, and turns trimming off, so freed memory stays there for reuse (larger blocks are
still mapped and unmapped: see the comment in the function). The process holds on to its
high-water mark, which the next step needs again anyway. It changes nothing where malloc
is not glibc's (the calls are then absent or ignored) and is not used on GPUs, whose
activations live in torch's caching allocator already.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (<malloc.h>)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and never trim it; True if glibc took both."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The threshold glibc's own adjustment would reach, fixed now: blocks up to 32 MiB
    # (activations, per-layer gradients) come from the heap. Larger ones stay separate
    # mappings: from the heap they fragmented it, and the trainer grew by ~0.8 GB over the
    # quickstart. The heap is never trimmed (-1, man mallopt).
    done = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(M_TRIM_THRESHOLD, -1)))
    logger.debug("malloc keeps freed memory: %s", done)
    return done
