"""Trainer side of an update: the Publisher and the engine targets it pushes to."""

from weightbus.core.publisher.publisher import Publisher
from weightbus.core.publisher.results import FleetVersion, PushError, PushResult
from weightbus.core.publisher.session import SessionFactory, normalize_weights
from weightbus.core.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    PushOrder,
    RollbackOrder,
    UpdateOrder,
)
from weightbus.core.transport import WeightsGroupError, WeightsGroupInfo

__all__ = [
    "EngineRequestError",
    "EngineResult",
    "EngineTarget",
    "EngineWeights",
    "FleetVersion",
    "HttpEngineTarget",
    "Publisher",
    "PushError",
    "PushOrder",
    "PushResult",
    "RollbackOrder",
    "SessionFactory",
    "UpdateOrder",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "normalize_weights",
]
