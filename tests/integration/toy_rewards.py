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
