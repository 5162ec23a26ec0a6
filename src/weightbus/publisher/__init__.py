"""Trainer side of an update: the Publisher and the engine targets it pushes to."""

from weightbus.publisher.publisher import Publisher, PushError, PushResult
from weightbus.publisher.session import SessionFactory, normalize_weights
from weightbus.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    UpdateOrder,
)
from weightbus.transport.dist.messages import WeightsGroupError, WeightsGroupInfo

__all__ = [
    "EngineRequestError",
    "EngineResult",
    "EngineTarget",
    "EngineWeights",
    "HttpEngineTarget",
    "Publisher",
    "PushError",
    "PushResult",
    "SessionFactory",
    "UpdateOrder",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "normalize_weights",
]
