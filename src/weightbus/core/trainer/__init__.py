"""The trainer side of a push as a group of ranks (one process holding every tensor is the group
of one): what each rank holds (`holdings`), the layout they agree on (`layout`), who sends which
cells (`cells`, `parts`) and who digests which blocks (`digests`), and how the ranks talk
(`group`). docs/sharded.md walks through it."""

from weightbus.core.trainer.group import TrainerGroup, TrainerRankError
from weightbus.core.trainer.holdings import DeclaredShard, Holding, fused_shards, holdings_of
from weightbus.core.trainer.layout import TrainerLayout

__all__ = [
    "DeclaredShard",
    "Holding",
    "TrainerGroup",
    "TrainerLayout",
    "TrainerRankError",
    "fused_shards",
    "holdings_of",
]
