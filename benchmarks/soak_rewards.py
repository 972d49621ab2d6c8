"""The soak benchmark's reward: reasoning-gym's, except that it hangs on the first run of one
item in $SOAK_HANG_EVERY (chosen by the item's id). Markers under $SOAK_MARKS remember which
items already hung: the reward runs in worker processes, which a timeout kills."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

from asyncrl.rewards.rgym import reasoning_gym_reward


def hangs_first(item_id: str, every: int) -> bool:
    return zlib.crc32(item_id.encode()) % every == 0


def hang_once(completion: str, item: dict[str, Any]) -> float:
    every = int(os.environ.get("SOAK_HANG_EVERY", "0"))
    if every and hangs_first(str(item["id"]), every):
        mark = Path(os.environ["SOAK_MARKS"]) / str(zlib.crc32(str(item["id"]).encode()))
        try:
            mark.touch(exist_ok=False)
        except FileExistsError:
            pass
        else:
            time.sleep(3600)  # the reward timeout ends it
    return reasoning_gym_reward(completion, item)
