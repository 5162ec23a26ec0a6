"""weightbus: fast, exact, versioned weight updates from RL trainers into live inference engines.

The names here are what a trainer types: `Publisher` and what it returns or raises, the
`EngineTarget` seam for engines of your own, and the transports' names. Three wings hold the
code: the library (`weightbus.core`), the engines it feeds (`weightbus.engines`: the reference
engine, vLLM) and the apps (`weightbus.apps`: bench, demo, plan, Ray fleets).
"""

import warnings
from typing import Any

from weightbus import _moved
from weightbus.core.digest import fingerprint, tensor_digest
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.meta import TensorMeta
from weightbus.core.publisher import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    FleetVersion,
    HttpEngineTarget,
    Publisher,
    PushError,
    PushResult,
)
from weightbus.core.transport import TransportEntry, register_transport, transport_names

_moved.install()

__version__ = "0.1.0"

__all__ = [
    "EngineRequestError",
    "EngineResult",
    "EngineTarget",
    "EngineWeights",
    "FleetVersion",
    "HttpEngineTarget",
    "NonFiniteWeightsError",
    "Publisher",
    "PushError",
    "PushResult",
    "TensorMeta",
    "TransportEntry",
    "__version__",
    "fingerprint",
    "register_transport",
    "tensor_digest",
    "transport_names",
]

# Planner internals were top-level names before; they live in `weightbus.core.plan`.
_FROM_PLAN = frozenset({"BucketEntry", "BucketPlan", "FlatBucket", "Plan", "plan_buckets"})


def __getattr__(name: str) -> Any:
    if name in _FROM_PLAN:
        warnings.warn(
            f"weightbus.{name} moved: import it from weightbus.core.plan",
            DeprecationWarning,
            stacklevel=2,
        )
        from weightbus.core import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'weightbus' has no attribute {name!r}")
