"""Rewards with signal for tiny random models (which never solve a real task)."""

import zlib


def text_hash(completion: str, item: dict) -> float:
    """A deterministic reward in [0, 1) that differs between almost any two completions."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000
