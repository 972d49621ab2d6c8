"""The rollout side of the controller: episodes run on an asyncio loop in their own thread.

The loop submits episodes while the staleness manager allows it, runs each through the
workflow, and keeps finished ones in a buffer. The trainer thread calls `next_batch()`,
which returns B episodes (each a group of trajectories), oldest first.

Episodes finish out of order, so taking whatever finished first could let a slow episode
outlive its bound. An episode started at version s must be trained by step s + eta (its
deadline). `next_batch()` at version k takes the B oldest finished episodes only if what is
left can still meet every deadline: nothing left due at k, and for each k < j < k + eta at
most (j - k) * B left episodes due by j. Later deadlines are met by construction: the
admission rule (docs/architecture.md) allows at most (j + 1) * B episodes due by j, ever. Otherwise
it waits for the stragglers. So every trajectory of every batch has k - start_version <= eta.

How far ahead (`admission`). "bound" (AReaL's rule) starts episodes as far ahead as eta
allows. Where generation outruns training (a small model, or cores the two share), that
keeps every batch eta versions old for no gain in throughput: the trainer never waits
either way, and on shared cores the extra episodes in flight take cores from it. "demand"
applies the admission rule with `ahead` <= eta versions (`StalenessManager.ahead`: 0 until
the first batch is handed out, so that batch is generated alone and arrives sooner, then 1)
and moves it by what the trainer saw: one version further if it waited for a batch longer
than WAIT_FRACTION of its step since the last batch, one less if a whole batch was left
over when it took one. Generation-bound runs climb to eta, as under "bound"; training-bound
runs stay near 1. Where trainer and servers share cores (`grow_ahead=False`) a trainer that
waits idles no core (the servers take its cores) and more episodes in flight would only
take cores from it, so `ahead` stays 1. The deadline rule above keeps eta, so the bound
holds whatever `ahead` is.

Dynamic sampling (`should_accept`): an episode the filter drops is handled like one the
workflow rejects: it leaves `running` without becoming `accepted`, which frees its slot for
a new episode (started at the then current version, so with a later deadline). Neither the
admission rule nor the deadline argument above counts it, so both still hold. Every
DROP_WARN_GROUPS_PER_BATCH * B drops in a row log a warning with the counts: a reward that
gives every sample the same score would otherwise leave the trainer waiting silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncrl.api import Batch, InferenceEngine, InferenceError, Trajectory, Workflow
from asyncrl.api.types import SAMPLING_SEED_KEY, mix_seed
from asyncrl.controller.rollout.staleness import StalenessManager

logger = logging.getLogger(__name__)
T = TypeVar("T")

# admission="demand": the trainer waiting longer than this fraction of its step (since the
# previous batch) for a batch lets episodes start one version further ahead, up to eta.
WAIT_FRACTION = 0.05
# Warn after this many batches' worth of groups were dropped in a row (and again each time).
DROP_WARN_GROUPS_PER_BATCH = 10


def frac_truncated_turns(trajs: list[Trajectory]) -> float:
    """The fraction of the model calls behind `trajs` cut at max_new_tokens: an agent's
    trajectory counts each of its turns (`meta["n_turns"]`, `meta["truncated_turns"]`),
    any other its one completion."""
    cut = sum(t.meta.get("truncated_turns", int(t.stop_reason.value == "length"))
              for t in trajs)
    return cut / sum(t.meta.get("n_turns", 1) for t in trajs)


class RolloutError(RuntimeError):
    """The rollout side cannot deliver batches (too many failed episodes, or a crash)."""


@dataclass
class Episode:
    seq: int  # submission order
    start_version: int
    trajectories: list[Trajectory]


@dataclass
class _Running:
    item: dict[str, Any]
    start_version: int
    task: asyncio.Task | None = None
    # An episode started from outside (an online agent session): what it awaits instead of
    # `workflow.run`. It cannot be re-run after a resume, so it is not saved as pending.
    external: Callable[[], Awaitable[list[Trajectory] | None]] | None = None
    attempt: int = 0  # earlier failed runs of this item (rollout.episode_retries)


class RolloutController:
    """Runs episodes continuously under the staleness bound; hands out training batches."""

    def __init__(self, engine: InferenceEngine, workflow: Workflow, stream: Any, *,
                 consumer_batch_size: int, max_head_offpolicyness: int,
                 max_concurrent_rollouts: int, max_failed_episodes: int = 16,
                 episode_retries: int = 0, seed: int | None = None,
                 should_accept: Callable[[list[Trajectory]], bool] | None = None,
                 admission: str = "bound", grow_ahead: bool = True) -> None:
        self.engine = engine
        self.workflow = workflow
        # An ItemStream: next(), state_dict(), load_state_dict(). None: episodes start only
        # from outside (`start_external`, online agent sessions).
        self.stream = stream
        self.eta = max_head_offpolicyness
        self.batch_size = consumer_batch_size
        self.max_failed_episodes = max_failed_episodes
        if episode_retries < 0:
            raise ValueError(f"rollout.episode_retries must be >= 0, got {episode_retries}")
        self.episode_retries = episode_retries
        self.should_accept = should_accept  # None: keep every finished episode
        # Not None: each item drawn from the stream gets its sampling seed, from this and
        # its draw number (`_drawn`), under SAMPLING_SEED_KEY (rollout.seeded_sampling).
        self.seed = seed
        self._drawn = 0
        if admission not in ("bound", "demand"):
            raise ValueError(f"rollout.admission must be 'bound' or 'demand', got {admission!r}")
        self.grow_ahead = grow_ahead  # False: "demand" stays one version ahead
        self.staleness = StalenessManager(consumer_batch_size, max_head_offpolicyness,
                                          max_concurrent_rollouts)
        if admission == "demand" and max_head_offpolicyness >= 1:
            # The first batch alone (sooner than beside a second); the next from its handout.
            self.staleness.ahead = 0
        self._asked: tuple[int, float] | None = None  # (version, when) of an unserved ask
        self._served_at: float | None = None  # when the last batch was handed out
        self._cond = threading.Condition()  # guards everything below
        self._version = 0
        self._buffer: list[Episode] = []
        self._pending: deque[dict[str, Any]] = deque()  # items to submit before new ones
        self._attempts: dict[int, int] = {}  # id(pending item) -> its failed runs so far
        self._running: dict[int, _Running] = {}
        self._next_seq = 0
        self._failures: list[str] = []
        self._reports: list[dict[str, Any]] = []  # failed runs not yet taken (take_failures)
        self._counts = {"episodes_failed": 0, "episodes_rejected": 0, "episodes_accepted": 0,
                        "episodes_retried": 0, "groups_dropped_total": 0}
        self._dropped_since_batch = 0  # groups dropped by should_accept since the last batch
        self._dropped_in_a_row = 0  # reset by the next kept group
        self._paused = False
        self._stopping = False
        self._crash: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (trainer thread) -------------------------------------------------
    def start(self, *, paused: bool = False) -> None:
        """Start the rollout thread; episodes begin at once unless `paused`."""
        self._paused = paused
        ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,),
                                        name="rollout", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel running episodes and stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
        self._poke()
        self._thread.join(timeout)
        self._thread = None

    def run_coroutine(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the rollout loop (shares its HTTP sessions) and wait for the result."""
        if self._loop is None:
            raise RuntimeError("rollout controller is not started")
        return self.submit_coroutine(coro).result(timeout)

    def submit_coroutine(self, coro: Coroutine) -> concurrent.futures.Future:
        """Start `coro` on the rollout loop; its future, to wait on later."""
        if self._loop is None:
            raise RuntimeError("rollout controller is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def set_version(self, version: int) -> None:
        """The servers now hold weights `version`: more episodes may start."""
        with self._cond:
            self._version = version
        self._poke()

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> bool:
        """Whether the rollout thread is up (its loop accepts `run_coroutine`)."""
        return self._thread is not None and self._loop is not None and not self._loop.is_closed()

    def pause(self) -> None:
        """Submit no new episodes (running ones continue)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
        self._poke()

    # ---- the trainer's side ---------------------------------------------------------
    def next_batch(self, timeout: float | None = None,
                   version: int | None = None) -> tuple[Batch, dict[str, float]]:
        """B episodes for training at weights `version`, oldest first, and their stats.

        `version` defaults to the servers' (`set_version`); a trainer whose servers are still
        loading its newest weights passes its own (k above), which is ahead of theirs.
        """
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        with self._cond:
            k = self._version if version is None else version
            if k < self._version:
                raise ValueError(f"next_batch(version={version}): the servers hold version "
                                 f"{self._version} already")
            if self._asked is None or self._asked[0] != k:  # a timed-out ask is the same wait
                self._asked = (k, now)
            while not self._batch_ready(k):
                self._raise_if_broken()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no training batch within {timeout} s "
                                       f"({len(self._buffer)}/{self.batch_size} episodes ready)")
                self._cond.wait(timeout=0.5)
            episodes, self._buffer = self._buffer[: self.batch_size], self._buffer[self.batch_size:]
            stats = self._batch_stats(episodes, k)
            self._dropped_since_batch = 0
            self._adapt_ahead(self._asked[1])
            self._asked = None
            stats["rollout/ahead"] = float(self.staleness.admitted_offpolicyness)
        self._poke()
        return Batch([t for e in episodes for t in e.trajectories]), stats

    def _batch_ready(self, k: int) -> bool:
        """Whether the B oldest finished episodes leave every other deadline reachable at k."""
        if len(self._buffer) < self.batch_size:
            return False
        self._buffer.sort(key=lambda e: (e.start_version, e.seq))
        left = sorted([e.start_version for e in self._buffer[self.batch_size:]]
                      + [r.start_version for r in self._running.values()])
        B = self.batch_size
        # left[i] is the (i+1)-th earliest start; its deadline is left[i] + eta.
        return all(i + 1 <= (start + self.eta - k) * B for i, start in enumerate(left)
                   if start + self.eta < k + self.eta)

    def _adapt_ahead(self, asked_at: float) -> None:
        """admission="demand": one version further ahead if the trainer waited for this batch
        (more than WAIT_FRACTION of its step since the last one), one less if a whole batch
        is left over. At the first batch (after a start or resume), which always waits: 1."""
        now = time.monotonic()
        previous, self._served_at = self._served_at, now
        ahead = self.staleness.ahead
        if ahead is None:
            return
        if previous is None:  # the first batch of a start or resume: at least one ahead
            self.staleness.ahead = max(1, ahead)
            return
        if now - asked_at > WAIT_FRACTION * max(asked_at - previous, 0.0):
            if self.grow_ahead:
                self.staleness.ahead = min(self.eta, ahead + 1)
        elif len(self._buffer) >= self.batch_size:
            self.staleness.ahead = max(1, ahead - 1)

    def _raise_if_broken(self) -> None:
        if self._crash is not None:
            raise RolloutError(f"rollout stopped: {type(self._crash).__name__}: {self._crash}") \
                from self._crash
        if self._thread is None:
            raise RolloutError("the rollout controller is not running")
        failed = self._counts["episodes_failed"]
        if 0 <= self.max_failed_episodes < failed:
            recent = "\n  ".join(self._failures[-3:])
            raise RolloutError(
                f"{failed} episodes failed (rollout.max_failed_episodes="
                f"{self.max_failed_episodes}); the last ones:\n  {recent}")

    def _batch_stats(self, episodes: list[Episode], version: int) -> dict[str, float]:
        trajs = [t for e in episodes for t in e.trajectories]
        staleness = [version - e.start_version for e in episodes]
        n_out = [t.n_output_tokens for t in trajs]
        mixed = [len(set(t.output_versions)) > 1 for t in trajs]
        return {
            # Online sessions train on reward - baseline; report what they earned.
            "rollout/reward": sum(t.meta.get("raw_reward", t.reward) for t in trajs) / len(trajs),
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/staleness_max": float(max(staleness)),
            "rollout/output_tokens_mean": sum(n_out) / len(n_out),
            "rollout/output_tokens": float(sum(n_out)),
            "rollout/frac_multi_version": sum(mixed) / len(mixed),
            "rollout/frac_truncated": sum(t.stop_reason.value == "length" for t in trajs) / len(trajs),
            # Of all model calls (an agent's trajectory holds several): cut at max_new_tokens.
            "rollout/frac_truncated_turns": frac_truncated_turns(trajs),
            "rollout/running": float(self.staleness.running),
            "rollout/buffered": float(len(self._buffer)),
            "rollout/groups_dropped": float(self._dropped_since_batch),
            **{f"rollout/{k}": float(v) for k, v in self._counts.items()},
        }

    # ---- exact resume ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, data position, finished and in-flight work (re-run after a resume)."""
        with self._cond:
            return {
                "version": self._version,
                "staleness": self.staleness.state_dict(),
                "stream": self.stream.state_dict() if self.stream is not None else None,
                "pending": list(self._pending) + [r.item for _, r in sorted(self._running.items())
                                                  if r.external is None],
                "buffer": list(self._buffer),
                "next_seq": self._next_seq,
                "drawn": self._drawn,
                "counts": dict(self._counts),
                "dropped_since_batch": self._dropped_since_batch,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("load the rollout state before start()")
        self._version = state["version"]
        self.staleness.load_state_dict(state["staleness"])
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        self._pending = deque(state["pending"])
        self._buffer = list(state["buffer"])
        self._next_seq = state["next_seq"]
        self._drawn = state.get("drawn", 0)  # older checkpoints: 0
        self._counts.update(state["counts"])
        self._dropped_since_batch = state.get("dropped_since_batch", 0)  # older checkpoints: 0

    # ---- the rollout thread ---------------------------------------------------------
    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    def _thread_main(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(ready))
        except BaseException as err:  # noqa: BLE001 - reported to the trainer by next_batch
            logger.exception("rollout thread crashed")
            with self._cond:
                self._crash = err
                self._cond.notify_all()
        finally:
            ready.set()
            self._loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._wake = asyncio.Event()
        ready.set()
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    self._submit_allowed()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
        finally:
            tasks = [r.task for r in self._running.values() if r.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _finish_stray_tasks()
            await self.engine.close()

    def _submit_allowed(self) -> None:
        """Start as many episodes as the staleness bound allows (holding the lock)."""
        if self._paused or self._crash is not None:
            return
        for _ in range(self.staleness.capacity(self._version)):
            if not self._pending and self.stream is None:
                return  # online: episodes start from outside (start_external)
            item = self._pending.popleft() if self._pending else self._draw()
            self._launch(_Running(item=item, start_version=self._version,
                                  attempt=self._attempts.pop(id(item), 0)))

    def _draw(self) -> dict[str, Any]:
        """The stream's next item, with its sampling seed when the run seeds sampling."""
        item = self.stream.next()
        self._drawn += 1
        if self.seed is not None and isinstance(item, dict):
            item = {**item, SAMPLING_SEED_KEY: mix_seed(self.seed, self._drawn)}
        return item

    def _launch(self, running: _Running) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._running[seq] = running
        self.staleness.on_submit()
        running.task = asyncio.get_running_loop().create_task(self._run_episode(seq, running))

    def start_external(self, make: Callable[[int], tuple[T, Callable[[], Awaitable[
            list[Trajectory] | None]]]]) -> T | None:
        """Start an episode from outside if the staleness bound allows it now, else None.

        `make(version)` builds it at the current version and returns (handle, run): `run()`
        awaits its trajectories (None or [] rejects it). Call this on the rollout loop (the
        agent proxy of online training runs there). It counts like any other episode.
        """
        with self._cond:
            if self._paused or self._stopping or self._crash is not None \
                    or self.staleness.capacity(self._version) < 1:
                return None
            handle, run = make(self._version)
            item = {"id": getattr(handle, "id", f"external-{self._next_seq}")}
            self._launch(_Running(item=item, start_version=self._version, external=run))
            return handle

    async def _run_episode(self, seq: int, running: _Running) -> None:
        t0 = time.monotonic()
        try:
            if running.external is not None:
                trajectories = await running.external()
            else:
                trajectories = await self.workflow.run(self.engine, running.item)
            keep = bool(trajectories) and (self.should_accept is None
                                           or bool(self.should_accept(trajectories)))
        except asyncio.CancelledError:
            raise
        except InferenceError as err:  # a broken engine: stop, naming the cause
            self._on_failure(seq, running, err, fatal=True)
            return
        except Exception as err:  # noqa: BLE001 - counted, logged with its input, reported
            self._on_failure(seq, running, err)
            return
        with self._cond:
            del self._running[seq]
            if not trajectories:
                self.staleness.on_reject()
                self._counts["episodes_rejected"] += 1
            elif not keep:
                self._on_drop()
            else:
                self._dropped_in_a_row = 0
                for t in trajectories:
                    t.meta.update(start_version=running.start_version,
                                  finish_version=self._version,
                                  episode_seq=seq, episode_time_s=time.monotonic() - t0)
                self._buffer.append(Episode(seq, running.start_version, trajectories))
                self.staleness.on_accept()
                self._counts["episodes_accepted"] += 1
            self._cond.notify_all()
        self._wake.set()

    def _on_drop(self) -> None:
        """Dynamic sampling dropped a finished group: free its slot, count it (holding the lock)."""
        self.staleness.on_reject()
        self._counts["groups_dropped_total"] += 1
        self._dropped_since_batch += 1
        self._dropped_in_a_row += 1
        if self._dropped_in_a_row % (DROP_WARN_GROUPS_PER_BATCH * self.batch_size) == 0:
            logger.warning(
                "dynamic sampling dropped the last %d finished groups in a row (%d dropped, %d "
                "kept in total; batch size %d): every sample of a prompt gets the same reward. "
                "Check the reward function, or raise gconfig.n_samples / temperature",
                self._dropped_in_a_row, self._counts["groups_dropped_total"],
                self._counts["episodes_accepted"], self.batch_size)

    def _on_failure(self, seq: int, running: _Running, err: Exception, *, fatal: bool = False) -> None:
        item_id = running.item.get("id", "?") if isinstance(running.item, dict) else "?"
        message = f"item {item_id}: {type(err).__name__}: {err}"
        retry = (not fatal and running.external is None
                 and running.attempt < self.episode_retries)
        if retry:
            logger.warning("episode failed (run %d of %d), running it again: %s",
                           running.attempt + 1, self.episode_retries + 1, message)
        else:
            logger.error("episode failed: %s", message)
        with self._cond:
            del self._running[seq]
            self._reports.append({"item_id": item_id, "error": f"{type(err).__name__}: {err}",
                                  "run": running.attempt + 1, "retried": retry,
                                  "start_version": running.start_version})
            self.staleness.on_reject()
            if retry:
                self._attempts[id(running.item)] = running.attempt + 1
                self._pending.append(running.item)
                self._counts["episodes_retried"] += 1
            else:
                if fatal and running.external is None:  # not the item's fault: run it again
                    self._pending.append(running.item)
                self._counts["episodes_failed"] += 1
                self._failures.append(message)
            if fatal and self._crash is None:
                self._crash = err
            self._cond.notify_all()
        self._wake.set()

    def take_failures(self) -> list[dict[str, Any]]:
        """The failed episode runs since the last call: item id, error, which run of the item
        it was, and whether it is run again (else it counts in `episodes_failed`)."""
        with self._cond:
            reports, self._reports = self._reports, []
        return reports


async def _finish_stray_tasks(timeout: float = 10.0) -> None:
    """Cancel and await what episodes left running on the loop (an agent's own tasks, a
    subprocess being reaped), so the loop closes with nothing pending."""
    stray = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in stray:
        t.cancel()
    if stray:
        await asyncio.wait(stray, timeout=timeout)
