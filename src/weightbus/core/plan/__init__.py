"""Planning and packing: which bytes of which tensor go where in which bucket."""

from weightbus.core.plan.bucket import ALIGN_BYTES, BucketEntry, FlatBucket, align_up
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES, BucketPlan, Plan, plan_buckets

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "BucketEntry",
    "BucketPlan",
    "FlatBucket",
    "Plan",
    "align_up",
    "plan_buckets",
]
