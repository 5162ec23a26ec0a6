"""Deprecated (one release): a sharded trainer builds `Publisher(engines, group=...)` on every
rank (docs/sharded.md). `ShardedPublisher` is that Publisher, on the default process group
unless given one, over `shm` unless told otherwise; the old module paths of this package
(`weightbus.core.sharded.holdings`, ...) lead to `weightbus.core.trainer`."""

import warnings
from typing import Any

import torch.distributed as dist

from weightbus.core.publisher.publisher import Publisher
from weightbus.core.publisher.results import PushResult
from weightbus.core.trainer import DeclaredShard, TrainerRankError, fused_shards

# one result type: every rank gets the Publisher's (`rank_sent_bytes`: each rank's bytes)
ShardedPushResult = PushResult


class ShardedPublisher(Publisher):
    """Deprecated: `Publisher(engines, group=group or dist.group.WORLD, transport="shm", ...)`;
    `direct=False` is `transport_options={"direct": False}` over `shm`."""

    def __init__(
        self,
        engines: Any = None,
        *,
        group: dist.ProcessGroup | None = None,
        transport: str = "shm",
        direct: bool = True,
        transport_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        warnings.warn(
            "ShardedPublisher is deprecated: build Publisher(engines, group=...) on every rank",
            DeprecationWarning,
            stacklevel=2,
        )
        transport_options = dict(transport_options or {})
        if transport == "shm" and not direct:
            transport_options["direct"] = False
        super().__init__(
            engines,
            group=group if group is not None else dist.group.WORLD,
            transport=transport,
            transport_options=transport_options,
            **options,
        )


__all__ = [
    "DeclaredShard",
    "ShardedPublisher",
    "ShardedPushResult",
    "TrainerRankError",
    "fused_shards",
]
