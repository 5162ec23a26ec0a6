"""Trainer side of an update: the Publisher (one process, or every rank of a sharded trainer)
and the engine targets it pushes to."""

from weightbus.core.publisher.publisher import Publisher
from weightbus.core.publisher.results import FleetVersion, PushError, PushResult
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
from weightbus.core.trainer import DeclaredShard, TrainerRankError, fused_shards
from weightbus.core.transport import WeightsGroupError, WeightsGroupInfo
from weightbus.core.weights import normalize_weights

__all__ = [
    "DeclaredShard",
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
    "TrainerRankError",
    "UpdateOrder",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "fused_shards",
    "normalize_weights",
]
