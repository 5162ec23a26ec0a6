"""Trainer side of an update: the Publisher and the engine targets it pushes to."""

from weightbus.publisher.publisher import Publisher
from weightbus.publisher.results import FleetVersion, PushError, PushResult
from weightbus.publisher.session import SessionFactory, normalize_weights
from weightbus.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    RollbackOrder,
    UpdateOrder,
)
from weightbus.transport.dist.messages import WeightsGroupError, WeightsGroupInfo

__all__ = [
    "EngineRequestError",
    "EngineResult",
    "EngineTarget",
    "EngineWeights",
    "FleetVersion",
    "HttpEngineTarget",
    "Publisher",
    "PushError",
    "PushResult",
    "RollbackOrder",
    "SessionFactory",
    "UpdateOrder",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "normalize_weights",
]
