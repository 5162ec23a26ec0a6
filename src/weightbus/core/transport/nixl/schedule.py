"""The write schedule of a session: per plan bucket, what the publisher packs for each rank and
where every packed byte lands in that rank's memory.

It depends only on the plan and the ranks' layouts (`DirectTarget` + where their memory
starts), so the publisher computes it once per layout and reuses it for every push. Each rank
receives exactly its share: a TP-2 rank gets half of a split tensor, never all of it.

A tensor of the plan that a rank's slice map does not name (a delta's payload) reaches that
rank whole, in its *inbox*: per bucket, such entries lie back to back at aligned offsets
(`inbox_entries`, computed the same way by the rank from the plan and its own slice map) in
one of the inbox's slots. The publisher packs each such entry once per bucket, in a shared
area after the ranks' areas of the send buffer, and every rank's WRITE reads it from there.

A trainer rank's schedule covers the tensors it sends whole (`sends`; in a group of one,
every tensor): the other entries of each bucket are other ranks' (or go in cells).
"""

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import ALIGN_BYTES, BucketEntry
from weightbus.core.transport.parts.layout import RegionCopy


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True, slots=True)
class SliceJob:
    """Rows `[start, stop)` of full tensor `name`, this rank's columns of them (`copy`), packed
    at `packed_offset` of the rank's area of a send buffer."""

    name: str
    copy: RegionCopy
    start: int
    stop: int
    packed_offset: int
    nbytes: int

    def source(self, full: torch.Tensor) -> torch.Tensor:
        """The view of `full` this job packs (row-major order = the order of its pieces)."""
        if full.dim() == 0:
            return full
        rows = full[self.start : self.stop]
        copy = self.copy.copy
        if copy.src_dim == 0:
            return rows
        return rows.narrow(copy.src_dim, copy.src_start, copy.length)


@dataclass(frozen=True, slots=True)
class WholeJob:
    """A bucket entry a rank receives whole, in its inbox: `entry` with its offset in the
    rank's inbox slot, packed at `packed_offset` of the send buffer (shared by every rank)."""

    entry: BucketEntry
    packed_offset: int


@dataclass(slots=True)
class RankWrites:
    """One rank's part of one bucket: the jobs to pack, then one WRITE of `local` (offsets in
    the rank's area) onto `remote` (`[address, length, 0]` rows in the rank's memory), plus
    the entries it receives whole (`whole`: into its inbox slot)."""

    jobs: list[SliceJob] = field(default_factory=list)
    local: list[np.ndarray] = field(default_factory=list)
    remote: list[np.ndarray] = field(default_factory=list)
    nbytes: int = 0
    whole: list[WholeJob] = field(default_factory=list)

    @property
    def whole_nbytes(self) -> int:
        return sum(job.entry.nbytes for job in self.whole)

    def add(self, job: SliceJob, pieces: np.ndarray) -> None:
        self.jobs.append(job)
        lengths = pieces[:, 1]
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
        self.local.append(np.uint64(job.packed_offset) + starts)
        self.remote.append(pieces)
        self.nbytes = job.packed_offset + job.nbytes

    def descriptors(
        self, area_address: int, buffer_address: int = 0, inbox_address: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """`(local, remote)` NIXL descriptor arrays (N x 3: address, length, device 0): the
        slices from the rank's area (at `area_address`) into its memory, then the whole
        entries from the send buffer (at `buffer_address`) into its inbox slot (at
        `inbox_address`)."""
        local_parts = [np.concatenate(self.local) + np.uint64(area_address)] if self.local else []
        remote_parts = list(self.remote)
        whole = [job for job in self.whole if job.entry.nbytes]
        if whole:
            lengths = np.array([job.entry.nbytes for job in whole], dtype=np.uint64)
            packed = np.array([job.packed_offset for job in whole], dtype=np.uint64)
            landing = np.array([job.entry.offset for job in whole], dtype=np.uint64)
            local_parts.append(packed + np.uint64(buffer_address))
            remote_parts.append(np.stack([landing + np.uint64(inbox_address), lengths], axis=1))
        if not remote_parts:
            empty = np.zeros((0, 3), dtype=np.uint64)
            return empty, empty.copy()
        remote = np.concatenate(remote_parts)
        local = np.concatenate(local_parts)
        zeros = np.zeros(len(remote), dtype=np.uint64)
        local_rows = np.stack([local, remote[:, 1], zeros], axis=1)
        remote_rows = np.stack([remote[:, 0], remote[:, 1], zeros], axis=1)
        return np.ascontiguousarray(local_rows), np.ascontiguousarray(remote_rows)


def entry_rows(meta: TensorMeta, entry: BucketEntry, bucket_bytes: int) -> tuple[int, int, int]:
    """`(first row, end row, row bytes)` of the full tensor that `entry` covers."""
    if not meta.shape:
        return 0, 1, meta.nbytes
    if meta.nbytes == 0:
        return 0, 0, 0
    row_bytes = meta.nbytes // meta.shape[0]
    if entry.tensor_offset % row_bytes or entry.nbytes % row_bytes:
        raise ValueError(
            f"nixl: tensor {meta.name!r} has rows of {row_bytes} bytes, more than a bucket of "
            f"{bucket_bytes} bytes; use a larger bucket_bytes"
        )
    start = entry.tensor_offset // row_bytes
    return start, start + entry.nbytes // row_bytes, row_bytes


def _pieces(base: int, each: RegionCopy, start: int, stop: int) -> np.ndarray:
    """`[address, length]` of the contiguous runs rows `[start, stop)` of the slice fill in
    the rank's memory, in row-major order."""
    param, copy, region = each.meta, each.copy, each.region
    origin = base + region.offset
    if not param.shape:
        return np.array([[origin, param.nbytes]], dtype=np.uint64)
    dim, itemsize = copy.src_dim, param.dtype.itemsize
    row_bytes = math.prod(param.shape[1:]) * itemsize
    if dim == 0:
        first = copy.dst_start + start - copy.src_start
        return np.array([[origin + first * row_bytes, (stop - start) * row_bytes]], np.uint64)
    if copy.length == param.shape[dim]:  # whole rows of the parameter: one run
        return np.array([[origin + start * row_bytes, (stop - start) * row_bytes]], np.uint64)
    inner = math.prod(param.shape[dim + 1 :]) * itemsize
    outer = np.arange(math.prod(param.shape[1:dim]), dtype=np.uint64) * (param.shape[dim] * inner)
    rows = np.arange(start, stop, dtype=np.uint64) * row_bytes
    addresses = (rows[:, None] + outer[None, :]).ravel() + (origin + copy.dst_start * inner)
    return np.stack([addresses, np.full_like(addresses, copy.length * inner)], axis=1)


def _rows_of_copy(each: RegionCopy, rows: tuple[int, int, int]) -> tuple[int, int] | None:
    """The rows of `rows` this copy takes (a row split narrows them), or None."""
    start, stop, _ = rows
    copy = each.copy
    if each.meta.shape and copy.src_dim == 0:
        start, stop = max(start, copy.src_start), min(stop, copy.src_start + copy.length)
    return (start, stop) if start < stop else None


def inbox_entries(bucket: BucketPlan, held: Container[str]) -> list[BucketEntry]:
    """The entries of `bucket` a rank whose slice map names `held` receives whole, each with
    its offset in the rank's inbox slot (back to back, aligned). Both ends compute it."""
    entries, offset = [], 0
    for entry in bucket.entries:
        if entry.name in held:
            continue
        entries.append(replace(entry, offset=offset))
        offset = _aligned(offset + entry.nbytes)
    return entries


def inbox_slot_bytes(per_bucket: Sequence[Sequence[BucketEntry]]) -> int:
    """The inbox slot that holds any bucket's whole entries (0: none needed)."""
    return max((_aligned(entries[-1].end) for entries in per_bucket if entries), default=0)


class Schedule:
    """Every bucket's writes to every rank of a session.

    Args:
        plan: the session's plan.
        ranks: per rank, `(address of its memory, its checked slice map)`; a tensor of the
            plan that the slice map lacks goes to the rank whole, into its inbox.
        sends: the tensors this schedule writes (None: every tensor of the plan); the other
            entries are left out (an inbox entry keeps its offset in the slot all the same).

    Attributes:
        buckets: `buckets[b][i]` is rank i's part of bucket b.
        slot_bytes: the send buffer one bucket needs (every rank's area, then the entries
            some rank receives whole, aligned).
        area_offsets: `area_offsets[b][i]`: where rank i's area starts in the send buffer.
        whole_offsets: `whole_offsets[b]`: name -> where bucket b's entry of that tensor is
            packed whole in the send buffer (entries no rank receives whole are absent).
        inbox_bytes: `inbox_bytes[i]`: the inbox slot rank i needs (0: none).
    """

    def __init__(
        self,
        plan: Plan,
        ranks: list[tuple[int, dict[str, list[RegionCopy]]]],
        sends: Container[str] | None = None,
    ) -> None:
        metas = {meta.name: meta for meta in plan.metas}
        self.sends = sends
        self.buckets: list[list[RankWrites]] = []
        self.area_offsets: list[list[int]] = []
        self.whole_offsets: list[dict[str, int]] = []
        self.slot_bytes = ALIGN_BYTES
        inboxes: list[list[list[BucketEntry]]] = [[] for _ in ranks]
        for bucket in plan.buckets:
            writes = [RankWrites() for _ in ranks]
            for entry in bucket.entries:
                if not self.sent(entry.name) or not any(entry.name in c for _, c in ranks):
                    continue  # another rank's, or whole to every rank: no rows to split
                rows = entry_rows(metas[entry.name], entry, plan.bucket_bytes)
                for (base, copies), rank_writes in zip(ranks, writes, strict=True):
                    for each in copies.get(entry.name, []):
                        self._add(rank_writes, entry.name, base, each, rows)
            offsets = [0]
            for rank_writes in writes:
                offsets.append(offsets[-1] + _aligned(rank_writes.nbytes))
            whole: dict[str, int] = {}
            end = offsets[-1]
            for (_, copies), rank_writes, inbox in zip(ranks, writes, inboxes, strict=True):
                entries = [e for e in inbox_entries(bucket, copies) if self.sent(e.name)]
                inbox.append(entries)
                for entry in entries:
                    if entry.name not in whole:
                        whole[entry.name] = end
                        end = _aligned(end + entry.nbytes)
                    rank_writes.whole.append(WholeJob(entry, whole[entry.name]))
            self.buckets.append(writes)
            self.area_offsets.append(offsets[:-1])
            self.whole_offsets.append(whole)
            self.slot_bytes = max(self.slot_bytes, end)
        self.inbox_bytes = [inbox_slot_bytes(inbox) for inbox in inboxes]

    def sent(self, name: str) -> bool:
        """Whether this schedule writes tensor `name`."""
        return self.sends is None or name in self.sends

    @staticmethod
    def _add(writes: RankWrites, name: str, base: int, each: RegionCopy, rows) -> None:
        taken = _rows_of_copy(each, rows)
        if taken is None:
            return
        pieces = _pieces(base, each, *taken)
        offset = _aligned(writes.nbytes)
        job = SliceJob(name, each, *taken, offset, int(pieces[:, 1].sum()))
        writes.add(job, pieces)
