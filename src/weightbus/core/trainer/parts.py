"""Parts of byte ranges: who writes which elements of a tensor sent in cells into a buffer laid
out by the plan (a slot, a shard file, a bucket's payload), each element by one rank that holds
it (a replicated one: the least loaded holder, as the cells choose)."""

from collections import defaultdict
from dataclasses import dataclass

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import Plan
from weightbus.core.trainer.boxes import Box, held_runs, matrix_shape, runs
from weightbus.core.trainer.digests import _cover
from weightbus.core.trainer.layout import TrainerLayout


@dataclass(frozen=True, slots=True)
class SlotPart:
    """`numel` elements of `rank`'s holding of `name` from local element `start`, into the slot
    at byte `slot_offset`."""

    rank: int
    name: str
    start: int
    numel: int
    slot_offset: int


def range_parts(
    layout: TrainerLayout,
    meta: TensorMeta,
    start: int,
    numel: int,
    *,
    offset: int,
    load: dict[int, int],
) -> list[SlotPart]:
    """Who writes elements `[start, start + numel)` of tensor `meta` (row-major) to byte
    `offset` of a buffer: a rank holding all of them (the least loaded), else the one holding
    most, the rest from the others (`load`: bytes each rank writes so far, updated)."""
    size, cols = meta.element_bytes, matrix_shape(meta.shape)[1]
    (run,) = runs(Box.whole(meta.shape), cols, start, start + numel)
    held = {rank: list(held_runs(box, cols, run)) for rank, box in layout.holders(meta.name)}
    whole = [rank for rank, ps in held.items() if sum(r.numel for r, _ in ps) == run.numel]
    owner = min(whole or list(held), key=lambda rank: (load[rank], rank))
    parts, position = [], run.start
    for segment in _cover(run, held, owner):
        destination = offset + (position - start) * size
        parts.append(SlotPart(segment.rank, meta.name, segment.start, segment.numel, destination))
        load[segment.rank] += segment.numel * size
        position += segment.numel
    return parts


def slot_schedule(layout: TrainerLayout, plan: Plan) -> list[list[SlotPart]]:
    """Per bucket, who writes which part of each entry sent in cells (the same on every
    rank; an entry of a tensor sent whole is its sender's, whole)."""
    metas = layout.metas_by_name
    load: dict[int, int] = defaultdict(int)
    buckets = []
    for bucket in plan.buckets:
        parts = []
        for entry in bucket.entries:
            if layout.sender(entry.name) is not None:
                continue  # sent whole by its sender
            meta = metas[entry.name]
            size = meta.element_bytes
            first, numel = entry.tensor_offset // size, entry.nbytes // size
            parts += range_parts(layout, meta, first, numel, offset=entry.offset, load=load)
        buckets.append(parts)
    return buckets
