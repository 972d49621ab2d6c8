"""AReaL-style `allocation_mode`: which inference backend, how many servers, how many trainers.

Grammar: `<backend>:d<N>[t1][p1]+[fsdp:]d<M>`, e.g. `vllm:d2+fsdp:d1`, `sglang:d4+fsdp:d4`,
`local:d1+fsdp:d1`. N inference servers (data parallel, one model copy each) and M trainer
ranks (FSDP). Tensor and pipeline parallel inference are not supported yet, so t and p
may only be 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BACKENDS = ("local", "vllm", "sglang")
_GEN = re.compile(r"^(?P<backend>[a-z]+):d(?P<dp>\d+)(?:t(?P<tp>\d+))?(?:p(?P<pp>\d+))?$")
_TRAIN = re.compile(r"^(?:(?P<engine>[a-z]+):)?d(?P<dp>\d+)$")


@dataclass(frozen=True)
class Allocation:
    backend: str
    n_servers: int
    trainer_world_size: int


def parse_allocation_mode(mode: str) -> Allocation:
    """Parse e.g. "vllm:d2+fsdp:d1"; ValueError naming the bad part otherwise."""
    parts = mode.replace(" ", "").split("+")
    if len(parts) != 2:
        raise ValueError(f"allocation_mode {mode!r} must be '<backend>:d<N>+fsdp:d<M>' (one '+' "
                         "between the inference and the training part), e.g. 'vllm:d2+fsdp:d1'")
    gen, train = parts
    g = _GEN.match(gen)
    if g is None:
        raise ValueError(f"allocation_mode {mode!r}: inference part {gen!r} is not "
                         f"'<backend>:d<N>' with backend one of {list(BACKENDS)}")
    if g["backend"] not in BACKENDS:
        raise ValueError(f"allocation_mode {mode!r}: backend {g['backend']!r} is not one of "
                         f"{list(BACKENDS)}")
    for axis, name in (("tp", "tensor"), ("pp", "pipeline")):
        if g[axis] is not None and int(g[axis]) != 1:
            raise ValueError(f"allocation_mode {mode!r}: {name} parallel inference "
                             f"({axis[0]}{g[axis]}) is not supported; use {axis[0]}1 or drop it")
    t = _TRAIN.match(train)
    if t is None:
        raise ValueError(f"allocation_mode {mode!r}: training part {train!r} is not 'fsdp:d<M>'")
    if t["engine"] not in (None, "fsdp"):
        raise ValueError(f"allocation_mode {mode!r}: training engine {t['engine']!r} is not "
                         "supported; use fsdp")
    n_servers, world = int(g["dp"]), int(t["dp"])
    if n_servers < 1 or world < 1:
        raise ValueError(f"allocation_mode {mode!r}: d must be >= 1 on both sides")
    return Allocation(g["backend"], n_servers, world)
