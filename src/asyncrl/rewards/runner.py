"""Run a reward function off the event loop, with a timeout, surfacing every failure.

By default each call runs in a worker process (started with `spawn`, so it shares no locks
or threads with the trainer). A process is the only thing that can be stopped when a
reward hangs: sympy can spin forever inside math-verify with the GIL held, which would
freeze a thread pool and the event loop with it. A worker that times out is killed and a
fresh one takes its place on the next call.

`processes=False` runs each call in a thread instead (no pickling, no start-up cost). A
call that times out is reported, but its thread cannot be stopped and runs on until the
function returns; use it for rewards that cannot hang.

As with any `spawn` process, a script that builds a process runner must guard its entry
point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import numbers
import pickle
import queue
import threading
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.api.protocols import RewardFn

_START_TIMEOUT_S = 120.0  # a worker imports the reward's module, which may be slow on a busy CPU
_COMPLETION_CHARS = 200  # of the completion quoted in an error


class RewardError(RuntimeError):
    """A reward function raised, hung, or returned something that is not a number."""

    def __init__(self, msg: str, *, fn_name: str, item_id: Any, completion: str):
        super().__init__(msg)
        self.fn_name = fn_name
        self.item_id = item_id
        self.completion = completion


class RewardTimeout(RewardError):
    """A reward function did not return within the runner's timeout."""


class _WorkerStartError(Exception):
    """A worker process could not import the reward function or did not start in time."""


class _RemoteTraceback(Exception):
    """Carries the worker's traceback text as the cause of a re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


def fn_name(fn: Any) -> str:
    """`module:qualname` of a function, for messages."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _serve(fn: RewardFn, conn) -> None:
    """Worker process main loop: score (completion, item) requests until the pipe closes."""
    conn.send(("ready", None))
    while True:
        try:
            completion, item = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(completion, item)))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
            tb = traceback.format_exc()
            try:
                conn.send(("error", (e, tb)))
            except Exception:  # noqa: BLE001 - the exception itself does not pickle
                conn.send(("error", (RuntimeError(f"{type(e).__name__}: {e}"), tb)))


class _Worker:
    """One child process that runs reward calls one at a time."""

    def __init__(self, ctx, fn: RewardFn):
        # kill() runs from the runner's close() and from the thread whose call failed,
        # possibly at once; closing the pipe twice concurrently can close a reused fd.
        self._kill_lock = threading.Lock()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(fn, child), daemon=True,
                                name=f"reward-{fn_name(fn)}")
        self.proc.start()
        child.close()
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise _WorkerStartError(f"reward worker did not start within {_START_TIMEOUT_S:.0f}s")
        try:
            self.conn.recv()  # "ready": the function was unpickled, its module imported
        except EOFError:
            self.kill()
            raise _WorkerStartError(f"reward worker exited with code {self.proc.exitcode} while "
                                    "starting (its traceback is on stderr)") from None

    def call(self, completion: str, item: dict[str, Any], timeout: float) -> tuple[str, Any]:
        """Blocking: send one request, wait up to `timeout` seconds for its outcome."""
        self.conn.send((completion, item))
        if not self.conn.poll(timeout):
            raise TimeoutError
        try:
            return self.conn.recv()
        except EOFError:
            raise EOFError(f"reward worker died with exit code {self.proc.exitcode}") from None

    def kill(self) -> None:
        """Stop the process and close the pipe, once, whichever thread calls first."""
        with self._kill_lock:
            if self.conn.closed:
                return
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()


class RewardRunner:
    """Score completions with `fn` off the event loop; failures raise `RewardError`."""

    def __init__(self, fn: RewardFn, timeout: float, *, workers: int = 2,
                 processes: bool = True):
        if timeout <= 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout}")
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.fn = fn
        self.name = fn_name(fn)
        self.timeout = timeout
        self.processes = processes
        self._workers = workers
        # Thread mode bounds concurrent calls per event loop (a semaphore belongs to one loop).
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if processes:
            _check_picklable(fn)
            self._ctx = multiprocessing.get_context("spawn")
            self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
            self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
            self._live: set[_Worker] = set()
            self._lock = threading.Lock()

    async def score(self, completion: str, item: dict[str, Any]) -> float:
        """The reward of `completion` for `item`; raises RewardError / RewardTimeout."""
        return (await self.score_with_info(completion, item))[0]

    async def score_with_info(self, completion: str,
                              item: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
        """The reward and the record the function gave with it (None: it gave a float)."""
        if self.processes:
            outcome = await self._score_in_process(completion, item)
        else:
            outcome = await self._score_in_thread(completion, item)
        return self._unpack(outcome, completion, item)

    def close(self) -> None:
        """Stop the worker processes."""
        if not self.processes:
            return
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._live = list(self._live), set()
        for w in workers:
            w.kill()

    # -- processes --------------------------------------------------------------------

    async def _score_in_process(self, completion: str, item: dict[str, Any]) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._threads, self._call_worker, completion, item)
        except TimeoutError:
            raise self._error(RewardTimeout, f"timed out after {self.timeout}s (worker killed)",
                              completion, item) from None
        except (_WorkerStartError, EOFError, OSError, pickle.PicklingError, TypeError) as e:
            raise self._error(RewardError, f"{type(e).__name__}: {e}", completion, item) from e

    def _call_worker(self, completion: str, item: dict[str, Any]) -> tuple[str, Any]:
        """Blocking: one call in an idle worker; a worker that hangs or fails is discarded."""
        worker = self._take_worker()
        try:
            outcome = worker.call(completion, item, self.timeout)
        except BaseException:
            self._discard(worker)
            raise
        self._idle.put(worker)
        return outcome

    def _take_worker(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            worker = _Worker(self._ctx, self.fn)
            with self._lock:
                self._live.add(worker)
            return worker

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.kill()

    # -- threads ----------------------------------------------------------------------

    async def _score_in_thread(self, completion: str, item: dict[str, Any]) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self._workers))
        async with slots:
            done: asyncio.Future = loop.create_future()

            def deliver(outcome: tuple[str, Any]) -> None:
                if not done.done():  # the caller may have timed out already
                    done.set_result(outcome)

            def target() -> None:
                try:
                    outcome = ("ok", self.fn(completion, item))
                except Exception as e:  # noqa: BLE001 - reported by _unpack
                    outcome = ("error", (e, None))
                try:
                    loop.call_soon_threadsafe(deliver, outcome)
                except RuntimeError:
                    pass  # the event loop closed while this call was running

            # A fresh daemon thread per call: a hung call must not hold a pool thread forever.
            threading.Thread(target=target, daemon=True, name=f"reward-{self.name}").start()
            try:
                return await asyncio.wait_for(done, self.timeout)
            except asyncio.TimeoutError:
                raise self._error(RewardTimeout, f"timed out after {self.timeout}s (its thread "
                                  "runs on)", completion, item) from None

    # -- outcomes ---------------------------------------------------------------------

    def _unpack(self, outcome: tuple[str, Any], completion: str,
                item: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
        status, value = outcome
        if status == "error":
            exc, remote_tb = value
            if remote_tb is not None:
                exc.__cause__ = _RemoteTraceback(remote_tb)
            raise self._error(RewardError, f"{type(exc).__name__}: {exc}", completion,
                              item) from exc
        info = None
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
            value, info = value
        is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value):
            raise self._error(RewardError, f"returned {value!r}, expected a finite number "
                              "or a (number, info dict) pair", completion, item)
        return float(value), info

    def _error(self, cls: type[RewardError], what: str, completion: str,
               item: dict[str, Any]) -> RewardError:
        item_id = item.get("id") if isinstance(item, dict) else None
        shown = completion if len(completion) <= _COMPLETION_CHARS else (
            completion[:_COMPLETION_CHARS] + f"... [{len(completion)} chars]")
        msg = f"reward {self.name} on item {item_id!r}: {what}; completion: {shown!r}"
        return cls(msg, fn_name=self.name, item_id=item_id, completion=completion)


def _check_picklable(fn: RewardFn) -> None:
    """Worker processes receive `fn` by reference: it must be a module-level callable."""
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(
            f"reward function {fn_name(fn)} cannot be sent to a worker process ({e}); define it "
            "at module level, or use RewardRunner(..., processes=False)"
        ) from e
