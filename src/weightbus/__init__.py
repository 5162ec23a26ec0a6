"""weightbus: fast, exact, versioned weight updates from RL trainers into live inference engines."""

from weightbus.digest import fingerprint, tensor_digest
from weightbus.meta import TensorMeta
from weightbus.plan import BucketEntry, BucketPlan, FlatBucket, Plan, plan_buckets
from weightbus.publisher import Publisher, PushError, PushResult

__version__ = "0.1.0"

__all__ = [
    "BucketEntry",
    "BucketPlan",
    "FlatBucket",
    "Plan",
    "Publisher",
    "PushError",
    "PushResult",
    "TensorMeta",
    "__version__",
    "fingerprint",
    "plan_buckets",
    "tensor_digest",
]
