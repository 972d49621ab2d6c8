"""AReaL-style `allocation_mode`: which inference backend, how many servers, how many trainers,
and whether they share GPUs.

Grammar: `<backend>:d<N>[t1][p1]<op>[fsdp:]d<M>`, e.g. `vllm:d2+fsdp:d1`, `sglang:d4+fsdp:d4`,
`local:d1|fsdp:d1`. N inference servers (data parallel, one model copy each) and M trainer
ranks (FSDP). The operator is AReaL's:
- `+` separate GPUs: the servers take N GPUs and the trainer ranks M others;
- `|` colocated: server i and trainer rank i share GPU i (so N must equal M), each with its
  share of the GPU's memory (`rollout.gpu_memory_fraction`). This is how one GPU runs a
  whole RL run: `local:d1|fsdp:d1` or `vllm:d1|fsdp:d1` with `cluster.n_gpus_per_node=1`.
On a CPU machine both mean the same: every process shares the machine's cores.
Tensor and pipeline parallel inference are not supported yet, so t and p may only be 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BACKENDS = ("local", "vllm", "sglang")
_GEN = re.compile(r"^(?P<backend>[a-z]+):d(?P<dp>\d+)(?:t(?P<tp>\d+))?(?:p(?P<pp>\d+))?$")
_TRAIN = re.compile(r"^(?:(?P<engine>[a-z]+):)?d(?P<dp>\d+)$")
_FORM = "'<backend>:d<N>+fsdp:d<M>' (separate GPUs) or '<backend>:d<N>|fsdp:d<N>' (shared)"


@dataclass(frozen=True)
class Allocation:
    backend: str
    n_servers: int
    trainer_world_size: int
    colocated: bool = False  # `|`: server i and trainer rank i on GPU i

    @property
    def n_gpus(self) -> int:
        """GPUs the allocation takes: one per server and one per rank, or one per pair."""
        if self.colocated:
            return self.trainer_world_size
        return self.n_servers + self.trainer_world_size


def parse_allocation_mode(mode: str) -> Allocation:
    """Parse e.g. "vllm:d2+fsdp:d1" or "local:d1|fsdp:d1"; ValueError naming the bad part."""
    text = mode.replace(" ", "")
    n_plus, n_bar = text.count("+"), text.count("|")
    if n_plus + n_bar != 1:
        raise ValueError(f"allocation_mode {mode!r} must be {_FORM}: one '+' or '|' between "
                         "the inference and the training part, e.g. 'vllm:d2+fsdp:d1'")
    colocated = n_bar == 1
    gen, train = text.split("|" if colocated else "+")
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
    if colocated and n_servers != world:
        raise ValueError(
            f"allocation_mode {mode!r}: '|' puts server i and trainer rank i on GPU i, so "
            f"both sides need the same d (here d{n_servers} and d{world}); use "
            f"'{g['backend']}:d{world}|fsdp:d{world}', or '+' for separate GPUs")
    return Allocation(g["backend"], n_servers, world, colocated)
