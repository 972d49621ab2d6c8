"""Rewards with signal for tiny random models (which never solve a real task)."""

import zlib


def text_hash(completion: str, item: dict) -> float:
    """A deterministic reward in [0, 1) that differs between almost any two completions."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def hash_or_constant(completion: str, item: dict) -> float:
    """0 for three items in four (all samples equal: DAPO drops the group), else `text_hash`.

    Which items are constant depends only on the item's id, so a run with a fixed seed
    drops the same groups every time.
    """
    if zlib.crc32(str(item["id"]).encode()) % 4:
        return 0.0
    return text_hash(completion, item)


def hangs_once(completion: str, item: dict) -> float:
    """Hangs the first time it scores an item of every third (by id), else `text_hash`.

    "First time" is a marker file per item under $TOY_REWARD_MARKS (the reward runs in
    worker processes, which a timeout kills and replaces).
    """
    import os
    import time
    from pathlib import Path

    if zlib.crc32(str(item["id"]).encode()) % 3 == 0:
        mark = Path(os.environ["TOY_REWARD_MARKS"]) / f"{zlib.crc32(str(item['id']).encode())}"
        try:
            mark.touch(exist_ok=False)
        except FileExistsError:
            return text_hash(completion, item)
        time.sleep(3600)
    return text_hash(completion, item)


def slow(completion: str, item: dict) -> float:
    """`text_hash` after 0.5 s: generation slower than a tiny model's training step."""
    import time

    time.sleep(0.5)
    return text_hash(completion, item)


def hash_parity(completion: str, item: dict) -> float:
    """1.0 for about half of all completions (by their CRC-32's parity), else 0.0."""
    return float(zlib.crc32(completion.encode()) % 2)


def first_word(completion: str) -> str | None:
    """The completion's first whitespace-separated word (an answer to vote over), or None."""
    words = completion.split()
    return words[0] if words else None


def always_zero(completion: str, item: dict) -> float:
    """0.0 for every answer: a reward that cannot tell answers apart."""
    return 0.0
