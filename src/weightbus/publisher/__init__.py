"""Trainer side of an update."""

from weightbus.publisher.publisher import EngineResult, Publisher, PushError, PushResult
from weightbus.publisher.weights import SessionFactory, normalize_weights

__all__ = [
    "EngineResult",
    "Publisher",
    "PushError",
    "PushResult",
    "SessionFactory",
    "normalize_weights",
]
