"""An endless, resumable stream of dataset items over epochs."""

from __future__ import annotations

import random
from typing import Any


class ItemStream:
    """Items in epoch order, reshuffled each epoch from (seed, epoch), resumable exactly.

    The order of epoch e depends only on (seed, e, number of items), so a stream restored
    from `state_dict()` yields exactly the items the original would have yielded next.
    """

    def __init__(self, items: list[dict[str, Any]], *, shuffle: bool, seed: int):
        if not items:
            raise ValueError("ItemStream needs at least one item (the dataset is empty)")
        self.items = items
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # epochs completed so far
        self.position = 0  # items of the current epoch already yielded
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> ItemStream:
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next()

    def next(self) -> dict[str, Any]:
        """The next item, starting a new (reshuffled) epoch after the last one."""
        if self.position == len(self.items):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        item = self.items[self._order[self.position]]
        self.position += 1
        return item

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches of `batch_size` items in one epoch (rounded down)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(self.items):
            raise ValueError(f"batch_size {batch_size} is larger than the dataset "
                             f"({len(self.items)} items)")
        return len(self.items) // batch_size

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is; `load_state_dict` of it continues with the same next item."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "n_items": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the dataset and shuffling must be the ones it was saved with."""
        saved = (state["n_items"], state["seed"], state["shuffle"])
        if saved != (len(self.items), self.seed, self.shuffle):
            raise ValueError(
                f"stream state was saved for (n_items, seed, shuffle)={saved}, but this stream "
                f"has {(len(self.items), self.seed, self.shuffle)}: the dataset or its config "
                "changed"
            )
        if not 0 <= state["position"] <= len(self.items):
            raise ValueError(f"stream position {state['position']} is outside 0..{len(self.items)}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            # A private generator keyed by (seed, epoch): independent of global RNG state.
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order
