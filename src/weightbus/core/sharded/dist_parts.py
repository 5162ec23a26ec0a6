"""Who sends what over `dist` from a sharded trainer: per bucket, each engine rank's regions
(what `dist` scatter would pack for it) cut into parts along the trainer ranks' boxes, each
part sent by one rank that holds it (a replicated part: the least loaded holder, as the direct
schedule chooses). The same on every trainer rank: it depends only on the trainer layout, the
plan and the engine ranks' slice maps; `parts_hash` lets rank 0 check it."""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import xxhash

from weightbus.core.plan import Plan
from weightbus.core.sharded.boxes import Box
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.schedule import cells
from weightbus.core.sharded.slots import range_parts
from weightbus.core.transport.distributed.parts import entry_box
from weightbus.core.transport.distributed.slices import SliceTarget
from weightbus.core.wire.messages import SentPart


@dataclass(frozen=True, slots=True)
class SendPart:
    """A part as its sender reads it: `cell` of tensor `name` (a typed region), or local
    elements `[start, start + numel)` of its holding (a chunk of bytes)."""

    part: SentPart
    name: str
    cell: Box | None
    start: int
    numel: int


# per bucket, per target: its parts in the order the payloads carry them
BucketParts = list[list[list[SendPart]]]


def bucket_parts(layout: TrainerLayout, plan: Plan, targets: Sequence[SliceTarget]) -> BucketParts:
    """Every bucket's parts for every target (the same on every trainer rank)."""
    metas = {meta.name: meta for meta in layout.metas}
    load: dict[int, int] = defaultdict(int)
    buckets = []
    for bucket in plan.buckets:
        per_target = []
        for target in targets:
            parts: list[SendPart] = []
            for index, entry in enumerate(bucket.entries):
                meta = metas[entry.name]
                box = entry_box(entry, target.slices.get(entry.name))
                if box is None:  # the bytes, whole: runs of elements, as the slots take them
                    size = meta.element_bytes
                    first, numel = entry.tensor_offset // size, entry.nbytes // size
                    for p in range_parts(layout, meta, first, numel, offset=0, load=load):
                        stop = p.slot_offset + p.numel * size
                        wire = SentPart(p.rank, index, p.slot_offset, stop, 0, 1)
                        parts.append(SendPart(wire, entry.name, None, p.start, p.numel))
                    continue
                region = Box(*box)
                holders = layout.holders(entry.name)
                for cell in cells(region, holders):
                    if not cell.numel:
                        continue
                    owners = [rank for rank, held in holders if cell.intersect(held) == cell]
                    owner = min(owners, key=lambda rank: (load[rank], rank))
                    load[owner] += cell.numel * meta.element_bytes
                    inner = cell.within(region)
                    wire = SentPart(owner, index, *msgspec.structs.astuple(inner))
                    parts.append(SendPart(wire, entry.name, cell, 0, cell.numel))
            per_target.append(parts)
        buckets.append(per_target)
    return buckets


def parts_hash(layout: TrainerLayout, parts: BucketParts) -> str:
    rows = [[[p.part for p in target] for target in bucket] for bucket in parts]
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode([layout.layout_hash, rows]))
