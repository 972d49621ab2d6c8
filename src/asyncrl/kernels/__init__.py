"""Small C kernels, compiled with the system's C compiler at first use: the CPU decode path's
(`decode.c`) and the trainer's log-prob head, RMSNorm, SwiGLU product, rotary embedding,
trie attention softmax and moves, gradient passes and AdamW step (`logprob_head.c`,
`rms_norm.c`, `swiglu.c`, `rope.c`, `masked_softmax.c`, `grad_ops.c`, `adamw.c`;
`trainer/cpu/logprob_head.py`, `trainer/cpu/norm.py`, `trainer/cpu/mlp.py`, `trainer/cpu/rope.py`,
`trainer/cpu/attention.py`, `trainer/cpu/grad_ops.py`, `trainer/cpu/optim.py`).

Each kernel is a plain C file next to this module (with `common.h`, the helpers they
share). `load()` compiles it once into the asyncrl cache and opens it with ctypes. The build
is tuned for this CPU (-march=native), so it is keyed by the sources, the compiler flags and
the CPU's model and flags: an edited kernel or header, or another CPU, gets its own build.
No torch headers are needed, so a build takes about a second. When no compiler is
available, `load()` returns None and callers keep their torch path; `ASYNCRL_NO_KERNELS=1`
forces that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from asyncrl.models.hub import cache_dir

logger = logging.getLogger(__name__)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]


def _build(name: str) -> Path:
    folder = resources.files(__package__)
    source = (folder / f"{name}.c").read_bytes()
    headers = {f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(".h")}
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(b"".join([source, *(headers[h] for h in sorted(headers))])
                         + " ".join([cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_bytes(source)
        for header, text in headers.items():
            (Path(tmp) / header).write_bytes(text)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(lib, out)  # atomic: concurrent builders each write their own temp file
    return out


def _cpu_id() -> str:
    """The CPU's model name and feature flags (a build for one CPU may not run on another)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.processor() or platform.machine()


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel library `name`, or None (logged once) where it cannot be built."""
    if os.environ.get("ASYNCRL_NO_KERNELS"):
        return None
    try:
        return ctypes.CDLL(str(_build(name)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("C kernel %r unavailable, using the torch path: %s", name, detail)
        return None


def bind(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """`load(name)` with the argument types of each named function set (each returns
    nothing), or None where the library cannot be built."""
    lib = load(name)
    if lib is None:
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = None
    return lib
