"""Who sends what over `dist` in parts mode: per bucket, each engine rank's regions
(`slices.entry_box`) cut into parts, each part sent by one trainer rank.

A tensor some trainer rank holds whole goes from its sender (`TrainerLayout.sender`) in one part
per region. A tensor no rank holds whole is cut along the holders' boxes into cells, each sent
by one rank that holds it (a replicated cell: the least loaded holder); a region needed as raw
bytes is cut into element ranges (`trainer.parts.range_parts`). Every trainer rank computes the
same schedule; `parts_hash` lets the leader check that they did.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import xxhash

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import Plan
from weightbus.core.plan.bucket import BucketEntry
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.cells import cells
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.parts import range_parts
from weightbus.core.transport.distributed.slices import SliceTarget, entry_box
from weightbus.core.wire.messages import SentPart, SliceSpec


@dataclass(frozen=True, slots=True)
class SendPart:
    """A part as its sender reads it: `cell` of tensor `name` (a box of the tensor's matrix,
    for a typed region), or local elements `[start, start + numel)` of its holding (raw
    bytes). `part` is what the receiving rank is told."""

    part: SentPart
    name: str
    cell: Box | None
    start: int
    numel: int


# per bucket, per target: its parts in the order the payloads carry them
BucketParts = list[list[list[SendPart]]]


def bucket_parts(layout: TrainerLayout, plan: Plan, targets: Sequence[SliceTarget]) -> BucketParts:
    """Every bucket's parts for every target (the same on every trainer rank)."""
    metas = layout.metas_by_name
    load: dict[int, int] = defaultdict(int)  # bytes each trainer rank sends so far
    return [
        [
            [
                part
                for index, entry in enumerate(bucket.entries)
                for part in _entry_parts(
                    layout,
                    metas[entry.name],
                    entry,
                    index,
                    spec=target.slices.get(entry.name),
                    load=load,
                )
            ]
            for target in targets
        ]
        for bucket in plan.buckets
    ]


def _entry_parts(
    layout: TrainerLayout,
    meta: TensorMeta,
    entry: BucketEntry,
    index: int,
    *,
    spec: SliceSpec | None,
    load: dict[int, int],
) -> list[SendPart]:
    """The parts of entry number `index` of a bucket for a rank with slice `spec`."""
    box = entry_box(entry, spec)
    sender = layout.sender(entry.name)
    if box is None:  # raw bytes: the entry's elements, in order
        size = meta.element_bytes
        first, numel = entry.tensor_offset // size, entry.nbytes // size
        if sender is not None:
            if not numel:
                return []
            wire = SentPart(sender, index, 0, entry.nbytes, 0, 1)
            return [SendPart(wire, entry.name, None, first, numel)]
        return [
            SendPart(
                SentPart(p.rank, index, p.slot_offset, p.slot_offset + p.numel * size, 0, 1),
                entry.name,
                None,
                p.start,
                p.numel,
            )
            for p in range_parts(layout, meta, first, numel, offset=0, load=load)
        ]
    region = Box(*box)
    if sender is not None:  # one part: the whole region, from the trainer's tensor
        owned = [(sender, region)] if region.numel else []
    else:
        owned = _cell_owners(layout, meta, region, load)
    return [
        SendPart(
            SentPart(owner, index, *msgspec.structs.astuple(cell.within(region))),
            entry.name,
            cell,
            0,
            cell.numel,
        )
        for owner, cell in owned
    ]


def _cell_owners(
    layout: TrainerLayout, meta: TensorMeta, region: Box, load: dict[int, int]
) -> list[tuple[int, Box]]:
    """`region` cut along the holders' boxes, each cell with the holder that sends it."""
    holders = layout.holders(meta.name)
    owned = []
    for cell in cells(region, holders):
        if not cell.numel:
            continue
        owners = [rank for rank, held in holders if cell.intersect(held) == cell]
        owner = min(owners, key=lambda rank: (load[rank], rank))
        load[owner] += cell.numel * meta.element_bytes
        owned.append((owner, cell))
    return owned


def parts_hash(layout: TrainerLayout, parts: BucketParts) -> str:
    """A hash of the schedule (the leader checks every rank follows its own)."""
    rows = [[[p.part for p in target] for target in bucket] for bucket in parts]
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode([layout.layout_hash, rows]))
