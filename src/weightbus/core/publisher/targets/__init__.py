"""Engine targets: the engines a Publisher pushes to (`base.EngineTarget`), one module each."""

from weightbus.core.publisher.targets.base import (
    EngineResult,
    EngineTarget,
    EngineWeights,
    PushOrder,
    RollbackOrder,
    UpdateOrder,
)
from weightbus.core.publisher.targets.http import HttpEngineTarget
from weightbus.core.transport.base import EngineRequestError

__all__ = [
    "EngineRequestError",
    "EngineResult",
    "EngineTarget",
    "EngineWeights",
    "HttpEngineTarget",
    "PushOrder",
    "RollbackOrder",
    "UpdateOrder",
]
