"""Trainer side of an update."""

from weightbus.publisher.publisher import (
    EngineResult,
    Publisher,
    PushError,
    PushResult,
    WeightsGroupError,
    WeightsGroupInfo,
)
from weightbus.publisher.weights import SessionFactory, normalize_weights

__all__ = [
    "EngineResult",
    "Publisher",
    "PushError",
    "PushResult",
    "SessionFactory",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "normalize_weights",
]
