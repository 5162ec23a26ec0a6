"""Sharded trainers: every trainer rank pushes the bytes it holds (docs/sharded.md)."""

from weightbus.core.sharded.control import TrainerRankError
from weightbus.core.sharded.holdings import DeclaredShard, fused_shards
from weightbus.core.sharded.publisher import ShardedPublisher, ShardedPushResult

__all__ = [
    "DeclaredShard",
    "ShardedPublisher",
    "ShardedPushResult",
    "TrainerRankError",
    "fused_shards",
]
