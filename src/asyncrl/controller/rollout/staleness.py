"""The staleness bound (docs/architecture.md).

B = consumer batch size (episodes per training step), v = current weight version,
eta = max_head_offpolicyness. A new episode may start only while

    accepted + running < (eta + v + 1) * B   and   running < max_concurrent.

Episodes are consumed B at a time, oldest first, and step k trains on weights of version k,
so no episode in a batch was started more than eta versions before the weights it trains.

`ahead` (rollout.admission=demand, set by the rollout controller): the rule above with
min(ahead, eta) in place of eta, so episodes start only as far ahead of training as the
trainer needs; None: eta itself (rollout.admission=bound).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StalenessManager:
    consumer_batch_size: int
    max_head_offpolicyness: int
    max_concurrent: int
    accepted: int = 0  # episodes finished and kept, ever (consumed ones included)
    running: int = 0
    rejected: int = 0  # episodes that failed or that the workflow rejected
    ahead: int | None = None  # versions episodes may start ahead; None: eta

    @property
    def admitted_offpolicyness(self) -> int:
        """The eta the admission rule applies now: min(ahead, eta), or eta."""
        eta = self.max_head_offpolicyness
        return eta if self.ahead is None else min(self.ahead, eta)

    def capacity(self, version: int) -> int:
        """How many new episodes may start now."""
        total_allowed = (self.admitted_offpolicyness + version + 1) * self.consumer_batch_size
        by_staleness = total_allowed - (self.accepted + self.running)
        by_concurrency = self.max_concurrent - self.running
        return max(0, min(by_staleness, by_concurrency))

    def on_submit(self) -> None:
        self.running += 1

    def on_accept(self) -> None:
        self._finish()
        self.accepted += 1

    def on_reject(self) -> None:
        self._finish()
        self.rejected += 1

    def _finish(self) -> None:
        if self.running <= 0:
            raise RuntimeError("staleness manager: an episode finished that was never submitted")
        self.running -= 1

    def state_dict(self) -> dict[str, int]:
        # Running episodes are re-submitted after a resume, so they are not running any more.
        state = {"accepted": self.accepted, "rejected": self.rejected}
        if self.ahead is not None:
            state["ahead"] = self.ahead
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accepted = state["accepted"]
        self.rejected = state["rejected"]
        self.running = 0
        if self.ahead is not None and "ahead" in state:  # a checkpoint of the demand rule
            self.ahead = max(1, min(state["ahead"], self.max_head_offpolicyness))

    def summary(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items()}
