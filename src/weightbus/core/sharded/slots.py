"""Sharded pushes through `shm` slots: every trainer rank packs its own bytes of each bucket.

The slot path serves engines that do not offer their parameters (vLLM workers, engines started
with `--no-shm-weights`). A bucket holds whole tensors (or chunks of rows) at fixed offsets, so
each trainer rank writes the parts of each entry it holds straight into the slot, and exactly one
rank writes each byte (a replicated part: the least loaded holder, as the direct schedule
chooses). The digests of the whole tensors, which the ranks of the engines check, are computed
first without a gather (`digests.compute`).
"""

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import Plan
from weightbus.core.sharded.boxes import Box, held_runs, matrix_shape, runs
from weightbus.core.sharded.control import GroupControl, run_all
from weightbus.core.sharded.digests import (
    DigestPlan,
    _cover,
    collected,
    compute,
    whole_regions,
)
from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.transport.parts.shared_memory import Slot


class SlotsOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's slots, and the plan every rank packs by."""

    slots: list[str]
    slot_bytes: int
    bucket_bytes: int
    plan_hash: str


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
    """Per bucket, who writes which part of each entry (the same on every rank)."""
    metas = {meta.name: meta for meta in layout.metas}
    load: dict[int, int] = defaultdict(int)
    buckets = []
    for bucket in plan.buckets:
        parts = []
        for entry in bucket.entries:
            meta = metas[entry.name]
            size = meta.element_bytes
            first, numel = entry.tensor_offset // size, entry.nbytes // size
            parts += range_parts(layout, meta, first, numel, offset=entry.offset, load=load)
        buckets.append(parts)
    return buckets


class PackReport(msgspec.Struct, frozen=True, kw_only=True):
    sent_bytes: int


class GroupSlots:
    """A trainer rank's side of sharded slot pushes (slots, schedules kept while unchanged)."""

    def __init__(self, control: GroupControl, pool: ThreadPoolExecutor) -> None:
        self._control = control
        self._pool = pool
        self._slots: dict[str, Slot] = {}
        self._compiled: dict[tuple, tuple[list[list[SlotPart]], DigestPlan]] = {}
        self._current: tuple[SlotsOrder, list[list[SlotPart]], DigestPlan] | None = None

    def begin(
        self,
        key: str,
        order: SlotsOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
    ) -> None:
        """Map the slots, compile the schedule, digest this rank's blocks and report them."""

        def work() -> bytes:
            self._map(order)
            compiled_key = (layout.layout_hash, order.plan_hash)
            if compiled_key not in self._compiled:
                plan = layout.plan(order.bucket_bytes, order.plan_hash)
                regions = whole_regions(layout)
                schedule = slot_schedule(layout, plan)
                self._compiled = {compiled_key: (schedule, DigestPlan(layout, regions))}
            schedule, digest_plan = self._compiled[compiled_key]
            self._current = (order, schedule, digest_plan)
            digests = compute(digest_plan, holdings, self._control, f"{key}/digests", deadline)
            return msgspec.msgpack.encode(digests)

        self._control.answer(f"{key}/digests", work)

    def _map(self, order: SlotsOrder) -> None:
        for name in [n for n in self._slots if n not in order.slots]:
            self._slots.pop(name).close()  # rank 0 made larger ones
        for name in order.slots:
            if name not in self._slots:
                self._slots[name] = Slot.open(name, order.slot_bytes)

    def digests(self, key: str, deadline: float) -> dict[str, str]:
        """Rank 0: every tensor's digest from the ranks' block digests."""
        assert self._current is not None
        return collected(self._current[2], self._control, f"{key}/digests", deadline)

    def pack(
        self, key: str, bucket: int, slot: int, holdings: dict[str, Holding], deadline: float
    ) -> None:
        """Write this rank's parts of `bucket` into `slot`, then report."""

        def work() -> bytes:
            assert self._current is not None, "a bucket before the slots"
            order, schedule, _ = self._current
            buffer = self._slots[order.slots[slot]].tensor
            mine = [part for part in schedule[bucket] if part.rank == self._control.rank]

            def copy(part: SlotPart) -> int:
                source = torch.from_numpy(holdings[part.name].bytes_of(part.start, part.numel))
                buffer[part.slot_offset : part.slot_offset + source.numel()].copy_(source)
                return source.numel()

            sent = run_all(self._pool, copy, mine, deadline, f"the parts of bucket {bucket}")
            return msgspec.msgpack.encode(PackReport(sent_bytes=sent))

        self._control.answer(f"{key}/bucket/{bucket}", work)

    def packed(self, key: str, bucket: int, deadline: float) -> list[int]:
        """Rank 0: every rank packed `bucket`; the bytes each wrote."""
        reports = self._control.collect(
            f"{key}/bucket/{bucket}", f"part of bucket {bucket}", deadline
        )
        return [
            msgspec.msgpack.decode(reports[r].body, type=PackReport).sent_bytes
            for r in sorted(reports)
        ]

    def close(self) -> None:
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()
