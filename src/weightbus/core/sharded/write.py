"""One sharded write over `shm` direct, as every trainer rank runs it.

Rank 0 announces the engine ranks' offered parameter files (`WriteOrder`); every rank maps
them, computes the schedule (`schedule.make_schedule`) and the digest plan (the whole tensors
for the fingerprint and, when the engines verify, each engine rank's slices), copies its own
pieces straight into the engines' parameters, hashes its blocks, and reports (`WriteReport`).
Rank 0 checks that every rank computed the same schedule and combines the digests.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from weightbus.core.plan import Plan
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.sharded.control import GroupControl, TrainerRankError, run_all
from weightbus.core.sharded.digests import (
    BlockDigests,
    DigestPlan,
    Region,
    combine,
    compute,
    whole_regions,
)
from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.schedule import (
    Piece,
    as_matrix,
    cell_view,
    make_schedule,
    schedule_hash,
)
from weightbus.core.transport.shm.direct import MappedTarget
from weightbus.core.wire import DirectTarget

# schedules kept: an atomic engine alternates between two arenas, a fleet has several engines
COMPILED_KEPT = 8


class WriteOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's order to write: the engine ranks' offers, in session order."""

    targets: list[DirectTarget]
    bucket_bytes: int
    plan_hash: str
    verify: bool


class WriteReport(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's write done: the schedule it followed, the bytes it copied, its block digests."""

    schedule_hash: str
    sent_bytes: int
    digests: BlockDigests


@dataclass(frozen=True)
class WriteOutcome:
    """What rank 0 learns from a write: digests by tensor, each engine rank's slice digests,
    the bytes each trainer rank copied."""

    digests: dict[str, str]
    slice_digests: list[dict[str, str]]
    sent_bytes: list[int]


def collect_outcome(
    control: GroupControl,
    key: str,
    layout: TrainerLayout,
    compiled: "Compiled",
    *,
    num_targets: int,
    deadline: float,
) -> WriteOutcome:
    """Rank 0: every rank's `WriteReport` on `key`, checked against `compiled` and combined.

    Raises:
        TrainerRankError: a rank failed or did not report in time, or followed another
            schedule (named).
    """
    reports = {
        rank: msgspec.msgpack.decode(message.body, type=WriteReport)
        for rank, message in control.collect(key, "write report", deadline).items()
    }
    for rank, report in reports.items():
        if report.schedule_hash != compiled.schedule_hash:
            raise TrainerRankError(f"trainer rank {rank} computed another schedule than rank 0")
    digests = combine(compiled.digest_plan, [r.digests for r in reports.values()])
    names = [meta.name for meta in layout.metas]
    slices: list[dict[str, str]] = [{} for _ in range(num_targets)]
    for target, name, region in compiled.slice_regions:
        slices[target][name] = digests[region]
    return WriteOutcome(
        digests=dict(zip(names, digests, strict=False)),
        slice_digests=slices,
        sent_bytes=[reports[rank].sent_bytes for rank in sorted(reports)],
    )


@dataclass(frozen=True)
class Compiled:
    """A write's schedule (its hash) and digest plan, kept per (trainer, engine) layouts."""

    pieces: list[Piece]
    schedule_hash: str
    digest_plan: DigestPlan
    slice_regions: list[tuple[int, str, int]]  # (engine rank, tensor, its region's index)

    @classmethod
    def of(
        cls, layout: TrainerLayout, slices: list[dict[str, list[ShardCopy]]], *, verify: bool
    ) -> "Compiled":
        """The schedule into engine ranks of `slices` (per rank: tensor -> its copies), and the
        digests: whole tensors, and with `verify` every engine rank's slices — each distinct
        region once (a slice that is the whole tensor, or the same slice of every replica,
        reuses its digest: hashing it again would exchange its cut blocks again)."""
        pieces = make_schedule(layout, slices)
        regions, slice_regions = whole_regions(layout), []
        index = {region: i for i, region in enumerate(regions)}
        if verify:
            for (target, name), box in sorted(
                {(p.target, p.name): p.slice_box for p in pieces}.items()
            ):
                region = Region(name, box)
                if region not in index:
                    index[region] = len(regions)
                    regions.append(region)
                slice_regions.append((target, name, index[region]))
        return cls(
            pieces, schedule_hash(layout, pieces), DigestPlan(layout, regions), slice_regions
        )


class GroupWriter:
    """A trainer rank's side of sharded `shm` direct writes (mapped files and schedules are
    kept while the layouts are unchanged)."""

    def __init__(self, control: GroupControl) -> None:
        self._control = control
        self._mapped: dict[str, MappedTarget] = {}
        self._compiled: dict[tuple, Compiled] = {}
        self.pool = ThreadPoolExecutor(
            max_workers=torch.get_num_threads(),
            thread_name_prefix="sharded-write",
            initializer=lambda: torch.set_num_threads(1),
        )

    def write(
        self,
        key: str,
        order: WriteOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
    ) -> None:
        """Copy this rank's pieces and report (`key`); a failure is reported, then raised."""

        def work() -> bytes:
            plan = layout.plan(order.bucket_bytes, order.plan_hash)
            targets = [self._map(offer, plan) for offer in order.targets]
            compiled = self._compile(layout, targets, order)
            sent = self._copy(compiled.pieces, targets, holdings, deadline)
            digests = compute(compiled.digest_plan, holdings, self._control, key, deadline)
            report = WriteReport(
                schedule_hash=compiled.schedule_hash, sent_bytes=sent, digests=digests
            )
            return msgspec.msgpack.encode(report)

        self._control.answer(key, work)

    def outcome(
        self, key: str, layout: TrainerLayout, order: WriteOrder, deadline: float
    ) -> WriteOutcome:
        """Rank 0: every rank's report, checked and combined.

        Raises:
            TrainerRankError: a rank failed or did not report in time, or followed another
                schedule (named).
        """
        compiled = self._compiled[self._key(layout, order)]
        return collect_outcome(
            self._control, key, layout, compiled, num_targets=len(order.targets), deadline=deadline
        )

    def _map(self, offer: DirectTarget, plan: Plan) -> MappedTarget:
        mapped = self._mapped.get(offer.file)
        if (
            mapped is None
            or mapped.key != (offer.file, offer.layout_hash, plan.plan_hash)
            or not mapped.is_current()
        ):
            if mapped is not None:
                mapped.close()
            mapped = self._mapped[offer.file] = MappedTarget(offer, plan)
        return mapped

    @staticmethod
    def _key(layout: TrainerLayout, order: WriteOrder) -> tuple:
        return (
            layout.layout_hash,
            order.plan_hash,
            order.verify,
            tuple(t.layout_hash for t in order.targets),
        )

    def _compile(
        self, layout: TrainerLayout, targets: list[MappedTarget], order: WriteOrder
    ) -> Compiled:
        key = self._key(layout, order)
        if key not in self._compiled:
            slices = [
                {name: [copy for copy, _ in copies] for name, copies in t.copies.items()}
                for t in targets
            ]
            if len(self._compiled) >= COMPILED_KEPT:  # engines that came and went
                self._compiled.clear()
            self._compiled[key] = Compiled.of(layout, slices, verify=order.verify)
        return self._compiled[key]

    def _copy(
        self,
        pieces: list[Piece],
        targets: list[MappedTarget],
        holdings: dict[str, Holding],
        deadline: float,
    ) -> int:
        def copy(piece: Piece) -> int:
            holding = holdings[piece.name]
            copy_of, param = targets[piece.target].copies[piece.name][piece.copy]
            local = holding.local.view(holding.box.rows, holding.box.cols)
            source = cell_view(local, holding.box, piece.cell)
            destination = cell_view(
                as_matrix(copy_of.destination(param)), piece.slice_box, piece.cell
            )
            destination.copy_(source)
            return destination.nbytes

        mine = [piece for piece in pieces if piece.owner == self._control.rank]
        mine.sort(key=lambda piece: -piece.cell.numel)  # largest first: the threads end together
        return run_all(self.pool, copy, mine, deadline, "this rank's copies")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
