"""Digests of regions of tensors held across trainer ranks, without a gather.

A tensor some rank holds whole is digested by its sender (`TrainerLayout.sender`); the others
here, as every digest is (`weightbus.core.digest`: a tree over a region's rows). `DigestPlan`
decides, the same on every rank, who hashes each leaf ("block"): a rank holding all of it (the
least loaded), else the one holding most of it, which receives the other parts over the control
store in rounds of at most `ROUND_BYTES` (no rank holds more than a round of bytes it does not
own). Rank 0 combines the leaves' digests into each region's (`combine`).
"""

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import xxhash

from weightbus.core.digest import combine_leaves, leaf_rows, tensor_digest
from weightbus.core.trainer.boxes import Box, Run, held_runs, matrix_shape, runs
from weightbus.core.trainer.group import ControlMessage, TrainerGroup
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout

# A round's parts travel as one store value per rank: TCPStore (libuv backend) refuses values
# over 8 MiB ("Invalid payload size"), so a round stays well below.
ROUND_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Region:
    """Box `box` of tensor `name`, digested in its own row-major order."""

    name: str
    box: Box


def whole_regions(layout: TrainerLayout) -> list[Region]:
    """Every tensor sent in cells (no rank holds it whole), whole: the regions of the
    fingerprint digested in blocks (a tensor sent whole is digested by its sender)."""
    return [
        Region(meta.name, Box.whole(meta.shape))
        for meta in layout.metas
        if layout.sender(meta.name) is None
    ]


@dataclass(frozen=True, slots=True)
class Segment:
    """`numel` elements of `rank`'s holding of a tensor, from local element `start`."""

    rank: int
    start: int
    numel: int


@dataclass(frozen=True, slots=True)
class Block:
    """Block `index` of region `region`: its segments in order, and who hashes it."""

    region: int
    index: int
    owner: int
    segments: tuple[Segment, ...]

    @property
    def split(self) -> bool:
        return any(segment.rank != self.owner for segment in self.segments)


class BlockDigests(msgspec.Struct, frozen=True, array_like=True):
    """A rank's block digests: `(region, block, digest)` triples."""

    digests: list[tuple[int, int, bytes]]


@dataclass
class DigestPlan:
    """Who hashes which block of each region (the same on every rank for the same layout)."""

    layout: TrainerLayout
    regions: Sequence[Region]
    blocks: list[Block] = field(init=False)
    block_counts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        metas = {meta.name: meta for meta in self.layout.metas}
        load: dict[int, int] = defaultdict(int)
        self.blocks, self.block_counts = [], []
        for index, region in enumerate(self.regions):
            meta = metas[region.name]
            cols = matrix_shape(meta.shape)[1]
            holders = self.layout.holders(region.name)
            width = region.box.cols  # the region's rows: its leaves are ranges of them
            leaves = leaf_rows(region.box.rows, width * meta.element_bytes)
            self.block_counts.append(len(leaves))
            for block, (first, stop) in enumerate(leaves):
                block_runs = list(runs(region.box, cols, first * width, stop * width))
                self.blocks.append(_assign(index, block, block_runs, holders, cols=cols, load=load))

    def rounds(self) -> list[list[Block]]:
        """The split blocks, in rounds of at most `ROUND_BYTES` (one block at least)."""
        rounds: list[list[Block]] = [[]]
        size = 0
        metas = self.layout.metas_by_name
        for block in (b for b in self.blocks if b.split):
            meta = metas[self.regions[block.region].name]
            nbytes = sum(s.numel for s in block.segments) * meta.element_bytes
            if rounds[-1] and size + nbytes > ROUND_BYTES:
                rounds.append([])
                size = 0
            rounds[-1].append(block)
            size += nbytes
        return [r for r in rounds if r]


def _assign(
    region: int,
    index: int,
    block_runs: list[Run],
    holders: list[tuple[int, Box]],
    *,
    cols: int,
    load: dict[int, int],
) -> Block:
    """The block's segments and its hasher: a rank holding all of it (least loaded), else the
    one holding most, the others' parts sent to it."""
    numel = sum(run.numel for run in block_runs)
    parts = {rank: [list(held_runs(box, cols, run)) for run in block_runs] for rank, box in holders}
    held = {rank: sum(r.numel for per_run in p for r, _ in per_run) for rank, p in parts.items()}
    whole = [rank for rank, count in held.items() if count == numel]
    if whole:
        owner = min(whole, key=lambda rank: (load[rank], rank))
        load[owner] += numel
        segments = [
            Segment(owner, local, r.numel) for per_run in parts[owner] for r, local in per_run
        ]
        return Block(region, index, owner, _merged(segments))
    owner = max(held, key=lambda rank: (held[rank], -rank))
    segments = []
    for run_index, run in enumerate(block_runs):
        segments += _cover(run, {rank: p[run_index] for rank, p in parts.items()}, owner)
    load[owner] += numel
    return Block(region, index, owner, _merged(segments))


def _cover(run: Run, parts: dict[int, list[tuple[Run, int]]], owner: int) -> list[Segment]:
    """`run` as segments of holders' memory: the owner's where it holds them, else the lowest
    rank's."""
    order = [owner, *sorted(rank for rank in parts if rank != owner)]
    segments, position = [], run.start
    while position < run.stop:
        for rank in order:
            found = next(
                ((r, local) for r, local in parts[rank] if r.start <= position < r.stop), None
            )
            if found is not None:
                part, local = found
                segments.append(Segment(rank, local + position - part.start, part.stop - position))
                position = part.stop
                break
        else:
            raise AssertionError(f"element {position} of a block is held by no rank")
    return segments


def _merged(segments: list[Segment]) -> tuple[Segment, ...]:
    """Consecutive segments of one rank's memory as one."""
    merged: list[Segment] = []
    for segment in segments:
        last = merged[-1] if merged else None
        if last and last.rank == segment.rank and last.start + last.numel == segment.start:
            merged[-1] = Segment(last.rank, last.start, last.numel + segment.numel)
        else:
            merged.append(segment)
    return tuple(merged)


def _hash(segments: Sequence[tuple[Segment, object]]) -> bytes:
    """xxh3-128 of the segments' bytes, in order."""
    if len(segments) == 1:
        return xxhash.xxh3_128_digest(segments[0][1])
    hasher = xxhash.xxh3_128()
    for _, data in segments:
        hasher.update(data)
    return hasher.digest()


def compute(
    plan: DigestPlan,
    holdings: dict[str, Holding],
    control: TrainerGroup,
    prefix: str,
    deadline: float,
) -> BlockDigests:
    """This rank's share of the digests: the blocks it holds whole, and the split blocks it
    owns once the others sent their parts (each round through the store).

    Raises:
        TrainerRankError: a rank did not send its parts in time, or failed (named).
    """
    rank = control.rank
    names = [region.name for region in plan.regions]
    results: list[tuple[int, int, bytes]] = []
    for block in plan.blocks:
        if block.owner == rank and not block.split:
            holding = holdings[names[block.region]]
            held = [(s, holding.bytes_of(s.start, s.numel)) for s in block.segments]
            results.append((block.region, block.index, _hash(held)))
    for number, blocks in enumerate(plan.rounds()):
        key = f"{prefix}/digest-round/{number}"
        results += _exchange_round(blocks, names, holdings, control, key=key, deadline=deadline)
    return BlockDigests(results)


def _exchange_round(
    blocks: list[Block],
    names: list[str],
    holdings: dict[str, Holding],
    control: TrainerGroup,
    *,
    key: str,
    deadline: float,
) -> list[tuple[int, int, bytes]]:
    """One round of split blocks: send this rank's parts to their owners, then digest the
    blocks it owns."""
    rank = control.rank
    outgoing: dict[int, list[bytes]] = defaultdict(list)
    for block in blocks:
        for segment in block.segments:
            if segment.rank == rank and block.owner != rank:
                data = holdings[names[block.region]].bytes_of(segment.start, segment.numel)
                outgoing[block.owner].append(bytes(data))
    body = msgspec.msgpack.encode({owner: b"".join(parts) for owner, parts in outgoing.items()})
    control.report(key, ControlMessage(body=body))
    mine = [block for block in blocks if block.owner == rank]
    if not mine:
        return []
    received = control.collect(key, "parts of the blocks it digests", deadline)
    streams = {
        sender: memoryview(
            msgspec.msgpack.decode(message.body, type=dict[int, bytes]).get(rank, b"")
        )
        for sender, message in received.items()
    }
    offsets: dict[int, int] = defaultdict(int)
    results = []
    for block in mine:
        holding = holdings[names[block.region]]
        size = holding.meta.element_bytes
        parts: list[tuple[Segment, object]] = []
        for segment in block.segments:
            if segment.rank == rank:
                parts.append((segment, holding.bytes_of(segment.start, segment.numel)))
                continue
            start, nbytes = offsets[segment.rank], segment.numel * size
            parts.append((segment, streams[segment.rank][start : start + nbytes]))
            offsets[segment.rank] = start + nbytes
        results.append((block.region, block.index, _hash(parts)))
    return results


def combine(plan: DigestPlan, reports: Sequence[BlockDigests]) -> list[str]:
    """Each region's digest from every rank's block digests.

    Raises:
        ValueError: a block's digest is missing or came twice.
    """
    blocks: list[list[bytes | None]] = [[None] * count for count in plan.block_counts]
    for report in reports:
        for region, index, digest in report.digests:
            if blocks[region][index] is not None:
                raise ValueError(f"block {index} of {plan.regions[region].name!r} digested twice")
            blocks[region][index] = digest
    metas = plan.layout.metas_by_name
    digests = []
    for region, per_block in zip(plan.regions, blocks, strict=True):
        if any(digest is None for digest in per_block):
            raise ValueError(f"a block of {region.name!r} was digested by no trainer rank")
        row_bytes = region.box.cols * metas[region.name].element_bytes
        digests.append(combine_leaves(region.box.rows, row_bytes, per_block))  # type: ignore[arg-type]
    return digests


class RankDigests(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's share of a version's digests: the tensors it sends whole (by name), and the
    blocks it hashed of the tensors sent in cells."""

    whole: dict[str, str]
    blocks: BlockDigests


def digest_share(
    holdings: dict[str, Holding],
    layout: TrainerLayout,
    group: TrainerGroup,
    key: str,
    deadline: float,
) -> RankDigests:
    """This rank's share of the digests (when no copy pass reads the bytes anyway): its whole
    tensors' digests, and its blocks of the others (exchanging cut blocks on `key`).

    Raises:
        TrainerRankError: a rank did not send its parts of a cut block in time (named).
    """
    whole = {
        name: tensor_digest(holdings[name].tensor)
        for name, rank in layout.senders.items()
        if rank == group.rank
    }
    plan = digest_plan(layout)
    blocks = compute(plan, holdings, group, key, deadline) if plan.regions else BlockDigests([])
    return RankDigests(whole=whole, blocks=blocks)


@functools.lru_cache(maxsize=8)
def digest_plan(layout: TrainerLayout) -> DigestPlan:
    """The plan of the blocks of the tensors sent in cells (kept per layout)."""
    return DigestPlan(layout, whole_regions(layout))


def combine_shares(layout: TrainerLayout, shares: Sequence[RankDigests]) -> dict[str, str]:
    """Every tensor's digest from every rank's share, by name, in the layout's order.

    Raises:
        ValueError: a tensor's digest is missing or came twice.
    """
    found: dict[str, str] = {}
    for share in shares:
        for name, digest in share.whole.items():
            if name in found:
                raise ValueError(f"tensor {name!r} was digested by two trainer ranks")
            found[name] = digest
    plan = digest_plan(layout)
    if plan.regions:
        split = combine(plan, [share.blocks for share in shares])
        found.update(zip((region.name for region in plan.regions), split, strict=True))
    missing = [meta.name for meta in layout.metas if meta.name not in found]
    if missing:
        raise ValueError(f"no trainer rank digested {missing[:3]} ({len(missing)} tensors)")
    return {meta.name: found[meta.name] for meta in layout.metas}
