"""`shm` on every trainer rank: each writes what it sends, straight into the engine ranks'
parameters (direct mode) or into the leader's slots.

A tensor the rank sends whole (`TrainerLayout.sender`; in a group of one, every tensor) is
copied by `DirectWriter`: every engine rank's slice in one pass over its rows, digested (whole,
and each slice) and, asked to, checked for NaN/inf chunk by chunk while in cache. A tensor no
rank holds whole is cut into cells (`trainer.cells`), each copied by one of its holders, and
digested in blocks (`trainer.digests`: a block cut by a shard boundary travels to one rank).
The leader's sink combines the reports and answers the engine ranks.
"""

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import msgspec
import torch

from weightbus.core.finite import refuse_nonfinite_chunk
from weightbus.core.plan import Plan
from weightbus.core.trainer.cells import Piece, as_matrix, cell_view
from weightbus.core.trainer.digests import BlockDigests, compute, digest_plan
from weightbus.core.trainer.group import run_all
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.parts import SlotPart, slot_schedule
from weightbus.core.trainer.writes import Cells, WriteReport
from weightbus.core.transport.parts.shared_memory import Slot
from weightbus.core.transport.sending import RankSender, RankWork
from weightbus.core.transport.shm.direct import DirectWriter, MappedTarget
from weightbus.core.wire import DirectTarget

# schedules kept: an atomic engine alternates between two arenas, a fleet has several engines
CELLS_KEPT = 8


class WriteOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Write straight into the engine ranks' parameters: their offers, in session order."""

    targets: list[DirectTarget]
    bucket_bytes: int
    plan_hash: str
    verify: bool


class SlotsOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Pack into the leader's slots: their names, and the plan every rank packs by."""

    slots: list[str]
    slot_bytes: int
    bucket_bytes: int
    plan_hash: str


class PackOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Pack your parts of `bucket` into slot `slot`."""

    bucket: int
    slot: int


class SlotsReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A rank's blocks of the tensors sent in cells (those sent whole digest as they pack)."""

    blocks: BlockDigests


class PackReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A rank's parts of a bucket packed: its bytes, and the digests of the tensors it sends
    whole that the bucket finishes."""

    sent_bytes: int
    digests: dict[str, str]


class ShmRankSender(RankSender):
    """A trainer rank's side of `shm` (mapped files, slots and schedules kept while the
    layouts are unchanged)."""

    order_type = WriteOrder | SlotsOrder | PackOrder
    report_type = WriteReport | SlotsReport | PackReport

    def __init__(self, group: object) -> None:
        super().__init__(group)  # type: ignore[arg-type]
        self._writer = DirectWriter()
        self._mapped: dict[str, MappedTarget] = {}
        self._cells: dict[tuple, Cells] = {}
        self._slots: dict[str, Slot] = {}
        self._slots_key: tuple | None = None
        self._slot_parts: list[list[SlotPart]] = []
        self._session: tuple[SlotsOrder, Plan] | None = None
        self._hashers: dict = {}

    def run(self, order: object, work: RankWork) -> object:
        if isinstance(order, WriteOrder):
            return self._write(order, work)
        if isinstance(order, SlotsOrder):
            return self._begin_slots(order, work)
        assert isinstance(order, PackOrder)
        return self._pack(order, work)

    # --- direct: straight into the engine ranks' parameters ---

    def _write(self, order: WriteOrder, work: RankWork) -> WriteReport:
        layout = work.layout
        plan = layout.plan(order.bucket_bytes, order.plan_hash)
        targets = [self._map(offer, plan) for offer in order.targets]
        self._forget_stale({offer.file for offer in order.targets})
        cells = self._compile(layout, targets, order)
        mine = _sent_whole(work)
        whole: dict[str, str] = {}
        whole_slices: dict[int, dict[str, str]] = defaultdict(dict)
        writes = self._writer.write(
            plan,
            mine,
            targets,
            work.deadline,
            slice_digests=order.verify,
            refuse_nonfinite=work.refuse_nonfinite,
        )
        for bucket_index, written in writes:
            digests = {name: digest for name, (digest, _) in written.items()}
            slices: dict[int, dict[str, str]] = defaultdict(dict)
            for name, (_, by_target) in written.items():
                for target, digest in by_target.items():
                    slices[target][name] = whole_slices[target][name] = digest
            if work.hooks is not None:  # the leader's sink tells the engine ranks at once
                work.hooks(bucket_index, digests, slices)
            whole.update(digests)
        sent = sum(target.slice_bytes.get(name, 0) for target in targets for name in mine)
        sent += self._copy(cells.pieces, targets, work)
        return WriteReport(
            schedule_hash=cells.schedule_hash,
            sent_bytes=sent,
            whole=whole,
            whole_slices=dict(whole_slices),
            blocks=cells.blocks(work.holdings, work.group, work.key, work.deadline),
        )

    def cells(self, layout: TrainerLayout, order: WriteOrder) -> Cells:
        """The leader: the write's cells (after its own part ran)."""
        return self._cells[_key(layout, order)]

    def _map(self, offer: DirectTarget, plan: Plan) -> MappedTarget:
        mapped = self._mapped.get(offer.file)
        key = (offer.file, offer.layout_hash, plan.plan_hash)
        if mapped is not None and mapped.key == key and mapped.is_current():
            return mapped
        if mapped is not None:
            mapped.close()
        mapped = self._mapped[offer.file] = MappedTarget(offer, plan)
        return mapped

    def _forget_stale(self, offered: set[str]) -> None:
        """Unmap files the engines freed or re-allocated. Files not offered now but still
        there stay: an atomic engine alternates between two arenas (live and staging swap on
        every commit), and re-mapping one costs a page fault per page on the next push."""
        for name in [n for n in self._mapped if n not in offered]:
            if not self._mapped[name].is_current():
                self._mapped.pop(name).close()

    def _compile(
        self, layout: TrainerLayout, targets: list[MappedTarget], order: WriteOrder
    ) -> Cells:
        key = _key(layout, order)
        if key not in self._cells:
            slices = [
                {name: [copy for copy, _ in copies] for name, copies in t.copies.items()}
                for t in targets
            ]
            if len(self._cells) >= CELLS_KEPT:  # engines that came and went
                self._cells.clear()
            self._cells[key] = Cells.of(layout, slices, verify=order.verify)
        return self._cells[key]

    def _copy(self, pieces: list[Piece], targets: list[MappedTarget], work: RankWork) -> int:
        """Copy this rank's cells; the bytes copied."""
        holdings = work.holdings

        def copy(piece: Piece) -> int:
            holding = holdings[piece.name]
            copy_of, param = targets[piece.target].copies[piece.name][piece.copy]
            source = cell_view(holding.matrix(), holding.box, piece.cell)
            destination = cell_view(
                as_matrix(copy_of.destination(param)), piece.slice_box, piece.cell
            )
            destination.copy_(source)
            if work.refuse_nonfinite and destination.is_floating_point():
                refuse_nonfinite_chunk(piece.name, destination)
            return destination.nbytes

        mine = [piece for piece in pieces if piece.owner == self.group.rank]
        mine.sort(key=lambda piece: -piece.cell.numel)  # largest first: the threads end together
        return run_all(self._writer.pool, copy, mine, work.deadline, "this rank's copies")

    # --- slots: every rank packs its parts of each bucket into the leader's slots ---

    def _begin_slots(self, order: SlotsOrder, work: RankWork) -> SlotsReport:
        for name in [n for n in self._slots if n not in order.slots]:
            self._slots.pop(name).close()  # the leader made larger ones
        for name in order.slots:
            if name not in self._slots:
                self._slots[name] = Slot.open(name, order.slot_bytes)
        layout = work.layout
        plan = layout.plan(order.bucket_bytes, order.plan_hash)
        key = (layout.layout_hash, order.plan_hash)
        if self._slots_key != key:
            self._slot_parts = slot_schedule(layout, plan)
            self._slots_key = key
        self._session, self._hashers = (order, plan), {}
        split = digest_plan(layout)
        blocks = BlockDigests([])
        if split.regions:
            blocks = compute(split, work.holdings, work.group, f"{work.key}/digests", work.deadline)
        return SlotsReport(blocks=blocks)

    def _pack(self, order: PackOrder, work: RankWork) -> PackReport:
        assert self._session is not None, "a bucket before the slots"
        slots, plan = self._session
        buffer = self._slots[slots.slots[order.slot]].tensor
        bucket = plan.buckets[order.bucket]
        mine = _sent_whole(work)
        parts = [p for p in self._slot_parts[order.bucket] if p.rank == self.group.rank]
        copies: list[Callable[[], int]] = [partial(_copy_part, buffer, work, p) for p in parts]
        digests = self._writer.pack(
            buffer,
            bucket,
            mine,
            self._hashers,
            refuse_nonfinite=work.refuse_nonfinite,
            extra=copies,
        )
        sent = sum(entry.nbytes for entry in bucket.entries if entry.name in mine)
        sent += sum(p.numel * work.layout.metas_by_name[p.name].element_bytes for p in parts)
        return PackReport(sent_bytes=sent, digests=digests)

    def close(self) -> None:
        self._writer.close()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()


def _sent_whole(work: RankWork) -> dict[str, torch.Tensor]:
    """The tensors this rank sends whole, by name."""
    rank = work.group.rank
    return {
        name: work.holdings[name].tensor
        for name, sender in work.layout.senders.items()
        if sender == rank
    }


def _copy_part(buffer: torch.Tensor, work: RankWork, part: SlotPart) -> int:
    source = torch.from_numpy(work.holdings[part.name].bytes_of(part.start, part.numel))
    destination = buffer[part.slot_offset : part.slot_offset + source.numel()]
    destination.copy_(source)
    if work.refuse_nonfinite:
        dtype = work.layout.metas_by_name[part.name].dtype
        if dtype.is_floating_point:
            refuse_nonfinite_chunk(part.name, destination.view(dtype))
    return source.numel()


def _key(layout: TrainerLayout, order: WriteOrder) -> tuple:
    return (
        layout.layout_hash,
        order.plan_hash,
        order.verify,
        tuple(t.layout_hash for t in order.targets),
    )
