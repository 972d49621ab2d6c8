"""Weight publication and sync to inference servers."""

from asyncrl.weights.publisher import WeightPublisher

__all__ = ["WeightPublisher"]
