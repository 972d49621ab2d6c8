"""Cores shared on demand between the processes of one machine (trainer and CPU servers).

With a fixed split, a 2-core machine gives the trainer one core and the inference server
the other, and each core idles whenever its owner waits: the server while the staleness
bound holds it back, the trainer while it waits for a batch. Here every party owns `home`
cores and says whether it is busy; a busy party also uses the home cores of the idle ones,
shared among the busy parties. Each party changes its torch thread count (OpenMP team
size; the engine's C kernels read the same count) at its own fine-grained boundaries:
the engine at every step, the trainer at every decoder layer, forward and backward, and
at every tensor of its compute copies' cast. So a party that wakes up gets its cores back
within one layer, tensor or decode step of the other's, and the threads at work never
outnumber the cores (OpenMP teams that do wait on each other at every barrier: a cast of
~80 ms took ~1 s when it ran on two threads beside a busy server). A server copying new
weights counts as busy, as the copy takes a core.

The state is a small shared-memory file: per slot its home cores and a busy flag, one
byte each, written by the slot's owner only, so no lock is needed. Processes are pointed
at it by the environment (`ASYNCRL_CORE_SHARE=<path>,<slot>`); `current()` is the share
of this process, if any.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

import torch

SLOTS = 64
TRAINER_SLOT = SLOTS - 1  # the inline trainer's; server i takes slot i
ENV = "ASYNCRL_CORE_SHARE"
_current: CoreShare | None = None


def threads_for(slot: int, homes: list[int], busy: list[bool]) -> int:
    """Threads of `slot`: its home cores, plus its share of the idle slots' home cores.

    The idle cores are divided among the busy slots in slot order, the first ones taking
    one more when they do not divide evenly. An idle slot keeps its home count.
    """
    own = homes[slot]
    if not busy[slot]:
        return max(own, 1)
    takers = [s for s, h in enumerate(homes) if h and busy[s]]
    spare = sum(h for s, h in enumerate(homes) if h and not busy[s])
    rank = takers.index(slot)
    return max(1, own + spare // len(takers) + (rank < spare % len(takers)))


class CoreShare:
    """One party's view of the shared state: its own slot to write, every slot to read."""

    def __init__(self, path: str, slot: int, home: int) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core-share slot must be in [0, {SLOTS}), got {slot}")
        if home < 1:
            raise ValueError(f"a party of the core share needs >= 1 home core, got {home}")
        self.path, self.slot, self.home = path, slot, home
        with open(path, "r+b") as f:
            self._mem = mmap.mmap(f.fileno(), 2 * SLOTS)
        self._mem[slot] = home
        self._mem[SLOTS + slot] = 0

    @staticmethod
    def create(path: str) -> str:
        """A new, empty share file at `path` (every slot absent)."""
        with open(path, "wb") as f:
            f.write(bytes(2 * SLOTS))
        return path

    @classmethod
    def from_env(cls, home: int) -> CoreShare | None:
        """The share named by ASYNCRL_CORE_SHARE (`<path>,<slot>`), or None if unset."""
        value = os.environ.get(ENV)
        if not value:
            return None
        path, _, slot = value.rpartition(",")
        if not path or not slot.isdigit():
            raise ValueError(f"{ENV} must be '<path>,<slot>', got {value!r}")
        return cls(path, int(slot), home)

    def close(self) -> None:
        """Leave the share: the slot becomes absent (its cores are no one's to borrow)."""
        if not self._mem.closed:
            self._mem[self.slot] = 0
            self._mem[SLOTS + self.slot] = 0
            self._mem.close()

    def homes_and_busy(self) -> tuple[list[int], list[bool]]:
        raw = self._mem[: 2 * SLOTS]
        return list(raw[:SLOTS]), [bool(b) for b in raw[SLOTS:]]

    def set_busy(self, busy: bool) -> None:
        self._mem[SLOTS + self.slot] = int(busy)

    def threads(self) -> int:
        """The threads this party may use now."""
        return threads_for(self.slot, *self.homes_and_busy())

    def adjust(self) -> int:
        """Set this thread's torch thread count to `threads()`; returns it."""
        n = self.threads()
        if n != torch.get_num_threads():  # per thread (OpenMP's count is the caller's)
            torch.set_num_threads(n)
        return n

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Busy for the block (nested blocks stay busy until the outermost ends)."""
        was = bool(self._mem[SLOTS + self.slot])
        self.set_busy(True)
        self.adjust()
        try:
            yield
        finally:
            if not was:
                self.set_busy(False)


def current() -> CoreShare | None:
    """This process's share, if it has joined one."""
    return _current


def join(share: CoreShare | None) -> CoreShare | None:
    """Make `share` this process's (None leaves it); returns the previous one."""
    global _current
    previous, _current = _current, share
    return previous


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """`current().busy()`, or nothing when this process shares no cores."""
    share = _current
    if share is None:
        yield
    else:
        with share.busy():
            yield


def adjust() -> None:
    """`current().adjust()`, or nothing when this process shares no cores."""
    if _current is not None:
        _current.adjust()
