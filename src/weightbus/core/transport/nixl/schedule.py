"""The write schedule of a trainer rank's tensors sent whole (`sends`; in a group of one, every
tensor): per plan bucket, what the rank packs for each engine rank and where every packed byte
lands in that engine rank's memory. It depends only on the plan and the engine ranks' layouts,
so it is computed once per layout; each engine rank receives exactly its share.

A tensor an engine rank's slice map does not name goes whole into its inbox (`NixlInbox`), at
the offsets `inbox_entries` gives; it is packed once per bucket, after the engine ranks' areas
of the send buffer.
"""

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import ALIGN_BYTES, BucketEntry, align_up
from weightbus.core.transport.parts.layout import RegionCopy


def run_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each run of `lengths` bytes starts when the runs are packed back to back."""
    return np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)


def descriptor_rows(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The NIXL descriptors (N x 3: address, bytes, device 0) of a WRITE of the runs starting
    at `local` addresses onto `remote` runs (`[address, bytes]` rows)."""
    zeros = np.zeros(len(remote), dtype=np.uint64)
    return (
        np.ascontiguousarray(np.stack([local, remote[:, 1], zeros], axis=1)),
        np.ascontiguousarray(np.stack([remote[:, 0], remote[:, 1], zeros], axis=1)),
    )


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
    """One rank's part of one bucket: the jobs to pack into its area (from `area` of the send
    buffer), then one WRITE of `local` (offsets in the area) onto `remote` (`[address, length]`
    rows in the rank's memory), plus the entries it receives whole (`whole`: into its inbox)."""

    area: int = 0
    jobs: list[SliceJob] = field(default_factory=list)
    local: list[np.ndarray] = field(default_factory=list)
    remote: list[np.ndarray] = field(default_factory=list)
    nbytes: int = 0
    whole: list[WholeJob] = field(default_factory=list)

    def add(self, name: str, base: int, each: RegionCopy, rows: tuple[int, int, int]) -> None:
        """The job of the rows of tensor `name` that `rows` (start, end, row bytes) covers and
        slice `each` takes, if any (the rank's memory starts at `base`)."""
        taken = _rows_of_copy(each, rows)
        if taken is None:
            return
        pieces = _pieces(base, each, *taken)
        job = SliceJob(name, each, *taken, align_up(self.nbytes), int(pieces[:, 1].sum()))
        self.jobs.append(job)
        self.local.append(np.uint64(job.packed_offset) + run_starts(pieces[:, 1]))
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
        return descriptor_rows(np.concatenate(local_parts), np.concatenate(remote_parts))


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
        offset = align_up(offset + entry.nbytes)
    return entries


def inbox_slot_bytes(per_bucket: Sequence[Sequence[BucketEntry]]) -> int:
    """The inbox slot that holds any bucket's whole entries (0: none needed)."""
    return max((align_up(entries[-1].end) for entries in per_bucket if entries), default=0)


class Schedule:
    """Every bucket's writes to every rank of a session.

    Args:
        plan: the session's plan.
        ranks: per rank, `(address of its memory, its checked slice map)`; a tensor of the
            plan that the slice map lacks goes to the rank whole, into its inbox.
        sends: the tensors this schedule writes; the other entries are left out (an inbox
            entry keeps its offset in the slot all the same).

    Attributes:
        plan: the session's plan.
        buckets: `buckets[b][i]` is rank i's part of bucket b.
        slot_bytes: the send buffer one bucket needs (every rank's area, then the entries
            some rank receives whole, aligned).
        inbox_bytes: `inbox_bytes[i]`: the inbox slot rank i needs (0: none).
    """

    def __init__(
        self,
        plan: Plan,
        ranks: list[tuple[int, dict[str, list[RegionCopy]]]],
        sends: set[str],
    ) -> None:
        metas = {meta.name: meta for meta in plan.metas}
        self.plan, self.sends = plan, sends
        self.buckets: list[list[RankWrites]] = []
        self.slot_bytes = ALIGN_BYTES
        inboxes: list[list[list[BucketEntry]]] = [[] for _ in ranks]
        for bucket in plan.buckets:
            writes = [RankWrites() for _ in ranks]
            for entry in bucket.entries:
                if entry.name not in sends or not any(entry.name in c for _, c in ranks):
                    continue  # another rank's, or whole to every rank: no rows to split
                rows = entry_rows(metas[entry.name], entry, plan.bucket_bytes)
                for (base, copies), rank_writes in zip(ranks, writes, strict=True):
                    for each in copies.get(entry.name, []):
                        rank_writes.add(entry.name, base, each, rows)
            end = 0
            for rank_writes in writes:
                rank_writes.area, end = end, end + align_up(rank_writes.nbytes)
            whole: dict[str, int] = {}
            for (_, copies), rank_writes, inbox in zip(ranks, writes, inboxes, strict=True):
                entries = [e for e in inbox_entries(bucket, copies) if e.name in sends]
                inbox.append(entries)
                for entry in entries:
                    if entry.name not in whole:
                        whole[entry.name] = end
                        end = align_up(end + entry.nbytes)
                    rank_writes.whole.append(WholeJob(entry, whole[entry.name]))
            self.buckets.append(writes)
            self.slot_bytes = max(self.slot_bytes, end)
        self.inbox_bytes = [inbox_slot_bytes(inbox) for inbox in inboxes]
