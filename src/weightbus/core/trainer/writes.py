"""A write into engine ranks' slices by every trainer rank (`shm` direct, `nixl`): the cells
no rank holds whole (`cells.make_schedule`) with the digests they need, each rank's report, and
what the leader makes of the reports: each tensor's digest and each engine rank's slice digests.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from weightbus.core.plan.shard import ShardCopy
from weightbus.core.trainer.cells import Piece, make_schedule, schedule_hash
from weightbus.core.trainer.digests import (
    BlockDigests,
    DigestPlan,
    Region,
    combine,
    compute,
    whole_regions,
)
from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout


class WriteReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A rank's write: its schedule, the bytes it sent, the digests of what it sent whole (and
    of each engine rank's slice of it: target -> name -> digest), its blocks of the rest."""

    schedule_hash: str
    sent_bytes: int
    whole: dict[str, str]
    whole_slices: dict[int, dict[str, str]]
    blocks: BlockDigests


@dataclass(frozen=True)
class Cells:
    """A write's schedule of cells (its hash) and the digest plan of what goes in cells."""

    pieces: list[Piece]
    schedule_hash: str
    digest_plan: DigestPlan
    slice_regions: list[tuple[int, str, int]]  # (engine rank, tensor, its region's index)

    @classmethod
    def of(
        cls, layout: TrainerLayout, slices: list[dict[str, list[ShardCopy]]], *, verify: bool
    ) -> "Cells":
        """The cells into engine ranks of `slices` (per rank: tensor -> its copies) and their
        digests: whole tensors, and with `verify` each distinct slice region once (hashing
        it again would exchange its cut leaves again)."""
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

    def blocks(
        self, holdings: dict[str, Holding], group: TrainerGroup, key: str, deadline: float
    ) -> BlockDigests:
        """This rank's blocks of the digests of what goes in cells (exchanged on the group
        under `<key>/digests`; none when nothing does).

        Raises:
            TrainerRankError: a rank did not send its parts in time, or failed (named).
        """
        if not self.digest_plan.regions:
            return BlockDigests([])
        return compute(self.digest_plan, holdings, group, f"{key}/digests", deadline)


@dataclass(frozen=True)
class WriteOutcome:
    """What the leader learns from a write: digests by tensor, each engine rank's slice
    digests, the bytes each trainer rank sent."""

    digests: dict[str, str]
    slice_digests: list[dict[str, str]]
    sent_bytes: list[int]


def write_outcome(
    layout: TrainerLayout, cells: Cells, reports: Sequence[WriteReport], num_targets: int
) -> WriteOutcome:
    """The leader: every rank's report, checked against `cells` and combined.

    Raises:
        ValueError: a rank followed another schedule than the leader's, or a digest is
            missing or came twice.
    """
    for rank, report in enumerate(reports):
        if report.schedule_hash != cells.schedule_hash:
            raise ValueError(f"trainer rank {rank} computed another schedule than rank 0")
    digests: dict[str, str] = {}
    slices: list[dict[str, str]] = [{} for _ in range(num_targets)]
    for report in reports:
        digests.update(report.whole)
        for target, found in report.whole_slices.items():
            slices[target].update(found)
    plan = cells.digest_plan
    if plan.regions:
        split = combine(plan, [report.blocks for report in reports])
        digests.update((region.name, split[i]) for i, region in enumerate(whole_regions(layout)))
        for target, name, region in cells.slice_regions:
            slices[target][name] = split[region]
    return WriteOutcome(
        digests={meta.name: digests[meta.name] for meta in layout.metas},
        slice_digests=slices,
        sent_bytes=[report.sent_bytes for report in reports],
    )
