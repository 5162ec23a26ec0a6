"""A trainer rank's WRITEs of the tensors it sends whole: per bucket, pack every engine rank's
slices into a send buffer (digesting them as they pass), post one NIXL WRITE per engine rank,
and follow each WRITE to its end, in bucket order.

In a group of one the leader's sink lends its sender `WriteHooks`: each engine rank is told
(`TensorsWritten`) as soon as its WRITE of a bucket is complete. Entries an engine rank
receives whole (tensors its slice map does not name: a delta's payload) are packed once per
bucket and travel in the same WRITE into the rank's inbox slot `bucket % slots`; before a slot
is written again the rank must have acknowledged (`SlotAck`, heard through the hooks) the
bucket it held."""

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weightbus.core.digest import TensorHasher
from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import (
    BucketEntry,
    byte_view,
    check_entry_tensor,
    digest_part,
    pack_entry,
    pack_rows,
)
from weightbus.core.transport.base import Progress
from weightbus.core.transport.nixl.hooks import InboxSlots, Rank, WriteHooks
from weightbus.core.transport.nixl.schedule import Schedule, SliceJob, entry_rows

logger = logging.getLogger(__name__)

# Between two looks at the transfers' state, when none finished (NIXL has no blocking wait).
POLL_PAUSE_S = 0.0002


def _slice_part(full: torch.Tensor, job: SliceJob, destination: torch.Tensor, hasher: Any):
    """A `pack_rows` part: `job`'s slice of the full rows goes to its packed `destination`."""
    if full.dim() == 0:
        return (lambda low, high: (destination, full)), hasher

    def views(low: int, high: int):
        first, last = max(low, job.start), min(high, job.stop)
        if first >= last:
            return None
        rows = slice(first - job.start, last - job.start)
        return destination[rows], job.source(full)[rows]

    return views, hasher


def _pack_slices(
    full: torch.Tensor,
    rows: tuple[int, int, int],
    jobs: list[tuple[SliceJob, torch.Tensor, Any]],
    full_hasher: Any,
) -> None:
    """Pack rows `[start, end)` of `full` (`rows`: start, end, row bytes) for every job (its
    packed destination and slice hasher), digesting the full rows and each packed slice chunk
    by chunk, from cache."""
    parts = [_slice_part(full, *job) for job in jobs]
    parts.append(digest_part(full, full_hasher))
    pack_rows(*rows, parts)


def _slice_shape(shape: tuple[int, ...], job: SliceJob) -> tuple[int, ...]:
    """The shape of the slice `job` packs rows of (the whole tensor's, narrowed)."""
    if not shape:
        return shape
    copy = job.copy.copy
    return (*shape[: copy.src_dim], copy.length, *shape[copy.src_dim + 1 :])


def _digest_entry(full: torch.Tensor, entry: BucketEntry, hasher: Any) -> None:
    """Digest `entry`'s bytes of `full` (contiguous) in place: nothing to copy."""
    hasher.update(byte_view(full)[entry.tensor_offset : entry.tensor_offset + entry.nbytes].numpy())


def _release(handle: Any) -> None:
    """Release a transfer handle, cancelling the transfer if it is still in flight."""
    try:
        handle.release()
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
        logger.warning("nixl: a transfer could not be released: %s", exc)


class BucketWrites:
    """A rank's WRITEs of the tensors it sends whole in one session (see the module docstring).

    Args:
        agent: the rank's `nixl_agent`, every engine rank's agent loaded.
        plan: the session's plan.
        tensors: the tensors `schedule` writes (`Schedule.sends`), by name.
        ranks: the session's engine ranks, in schedule order.
        buffers: registered send buffers of `schedule.slot_bytes` at least (bucket b packs
            into `buffers[b % len(buffers)]`).
        verify: digest each engine rank's slices too (the ranks verify them).
        inboxes: per engine rank (schedule order), its inbox, or None: every rank that
            receives entries whole needs one.
        hooks: the leader's sink's, in a group of one (else the defaults).

    Raises:
        ValueError: an engine rank receives tensors whole and offered no inbox large enough,
            or no inbox can be used (`hooks.acks` is None).

    Attributes:
        digests: the digest of every tensor written so far, by name.
        slice_digests: per engine rank, the digests of its slices written so far.
        rank_bytes: per engine rank, the bytes written into it.
        sent_bytes: the tensor bytes posted in WRITEs (summed over engine ranks).
    """

    def __init__(
        self,
        agent: Any,
        plan: Plan,
        *,
        tensors: Mapping[str, torch.Tensor],
        ranks: list[Rank],
        schedule: Schedule,
        buffers: list[torch.Tensor],
        verify: bool,
        inboxes: Sequence[InboxSlots | None] = (),
        hooks: WriteHooks | None = None,
    ) -> None:
        self._agent, self._plan, self._tensors = agent, plan, tensors
        self._ranks, self._schedule, self._buffers = ranks, schedule, buffers
        self._verify = verify
        self._hooks = WriteHooks() if hooks is None else hooks
        self._inboxes = list(inboxes) or [None] * len(ranks)
        self._acks = self._hooks.acks if self._hooks.acks is not None else set()
        self._listen = self._hooks.listen
        for rank, need in zip(ranks, schedule.inbox_bytes, strict=True):
            inbox = self._inboxes[rank.index]
            if need and self._hooks.acks is None:
                raise ValueError(
                    f"{rank.describe()} receives tensors whole (not its parameters): only a "
                    "trainer group of one sends such tensors over nixl"
                )
            if need and (inbox is None or inbox.slot_bytes < need):
                raise ValueError(
                    f"{rank.describe()} receives tensors whole and offered no inbox of {need} bytes"
                )
        # per rank: inbox slot -> the last bucket written into it
        self._inbox_use: list[dict[int, int]] = [{} for _ in ranks]
        self._metas = {meta.name: meta for meta in plan.metas}
        # a non-contiguous tensor split across buckets is made contiguous once, not per bucket
        self._contiguous: dict[str, torch.Tensor] = {}
        self._full_hashers: dict[str, Any] = {}
        self._slice_hashers: dict[tuple[str, int], Any] = {}
        self._pending: list[tuple[int, Rank, Any]] = []  # (bucket, rank, transfer handle)
        self._done: list[set[int]] = []  # per posted bucket: the rank indices written
        self._notices: list[tuple[dict[str, str], list[dict[str, str]]]] = []
        self._next_notice = [0] * len(ranks)
        self._reported = 0  # buckets reported to `progress`
        self.digests: dict[str, str] = {}
        self.slice_digests: list[dict[str, str]] = [{} for _ in ranks]
        self.rank_bytes = [0] * len(ranks)
        self.sent_bytes = 0

    def run(self, pool: ThreadPoolExecutor, deadline: float) -> None:
        """Write every bucket; return once every WRITE completed (and, with hooks, every rank
        was told of every bucket).

        Raises:
            TimeoutError: a WRITE did not complete by `deadline` (it names the rank).
            RuntimeError: NIXL failed a WRITE (it names the rank).
            ValueError: a tensor does not match the plan, or the push was abandoned.
        """
        buckets = self._plan.buckets
        progress = self._hooks.progress
        depth = len(self._buffers)
        # bucket k+1 packs while bucket k is posted: on one host a WRITE is a CMA copy made
        # inside `transfer`, so packing after it would leave the copies in series
        with ThreadPoolExecutor(1, thread_name_prefix="nixl-packer") as packer:
            try:
                packed = self._start_pack(packer, pool, buckets[0], deadline, progress)
                for bucket, following in zip(buckets, [*buckets[1:], None], strict=True):
                    packed.result(max(0.0, deadline - time.monotonic()))
                    if following is not None and depth > 1:  # its buffer is not this one's
                        packed = self._start_pack(packer, pool, following, deadline, progress)
                    self._claim_inboxes(bucket, deadline, progress)
                    self._post(bucket, self._buffers[bucket.index % depth])
                    self._advance(progress)
                    if following is not None and depth == 1:
                        packed = self._start_pack(packer, pool, following, deadline, progress)
                self._wait_for(len(buckets) - 1, deadline, progress)
            finally:
                for _, _, handle in self._pending:
                    _release(handle)

    def _start_pack(
        self,
        packer: ThreadPoolExecutor,
        pool: ThreadPoolExecutor,
        bucket: BucketPlan,
        deadline: float,
        progress: Progress,
    ) -> Future:
        """Pack `bucket` on the packer thread, once the bucket that used its buffer before
        was written everywhere."""
        depth = len(self._buffers)
        if bucket.index >= depth:
            self._wait_for(bucket.index - depth, deadline, progress)
        buffer = self._buffers[bucket.index % depth]
        return packer.submit(self._pack, pool, bucket, buffer, deadline)

    def _pack(
        self, pool: ThreadPoolExecutor, bucket: BucketPlan, buffer: torch.Tensor, deadline: float
    ) -> None:
        by_name: dict[str, list[tuple[SliceJob, torch.Tensor, Any]]] = {}
        for rank, writes in zip(self._ranks, self._schedule.buckets[bucket.index], strict=True):
            area = self._schedule.area_offsets[bucket.index][rank.index]
            for job in writes.jobs:
                by_name.setdefault(job.name, []).append(self._destination(rank, job, buffer, area))
            self.rank_bytes[rank.index] += writes.whole_nbytes
        whole = self._schedule.whole_offsets[bucket.index]
        sent = self._schedule.sent
        futures = [
            pool.submit(
                self._pack_one, entry, by_name.get(entry.name, []), buffer, whole.get(entry.name)
            )
            for entry in sorted(bucket.entries, key=lambda entry: -entry.nbytes)
            if sent(entry.name)
        ]
        for future in futures:
            future.result(max(0.0, deadline - time.monotonic()))
        finished = [name for name in bucket.finished_names() if sent(name)]
        for name in finished:
            self._contiguous.pop(name, None)
        digests = {name: self._full_hashers.pop(name).hexdigest() for name in finished}
        self.digests.update(digests)
        slices = [
            {
                name: self._slice_hashers.pop((name, rank.index)).hexdigest()
                for name in finished
                if (name, rank.index) in self._slice_hashers
            }
            for rank in self._ranks
        ]
        for found, rank in zip(slices, self._ranks, strict=True):
            self.slice_digests[rank.index].update(found)
        self._notices.append((digests, slices))

    def _destination(self, rank: Rank, job: SliceJob, buffer: torch.Tensor, area: int):
        full = self._tensors[job.name]
        start = area + job.packed_offset
        shape = job.source(full).shape
        destination = buffer[start : start + job.nbytes].view(full.dtype).view(shape)
        hasher = None
        if self._verify:
            key = (job.name, rank.index)
            hasher = self._slice_hashers.get(key)
            if hasher is None:  # the digest of the region the rank re-reads: its slice's shape
                hasher = self._slice_hashers[key] = TensorHasher.of_shape(
                    _slice_shape(self._metas[job.name].shape, job), full.element_size()
                )
        self.rank_bytes[rank.index] += job.nbytes
        return job, destination, hasher

    def _pack_one(
        self, entry: BucketEntry, jobs: list, buffer: torch.Tensor, whole_offset: int | None
    ) -> None:
        tensor = self._tensors.get(entry.name)
        if tensor is None:
            raise ValueError(f"tensor {entry.name!r} is in the plan but was not given")
        check_entry_tensor(entry, tensor)
        full = tensor if tensor.is_contiguous() else self._contiguous.get(entry.name)
        if full is None:
            full = self._contiguous[entry.name] = tensor.contiguous()
        hasher = self._full_hashers.get(entry.name)
        if hasher is None:
            hasher = self._full_hashers[entry.name] = TensorHasher.of(full)
        if jobs:  # digests the full rows too
            rows = entry_rows(self._metas[entry.name], entry, self._plan.bucket_bytes)
            _pack_slices(full, rows, jobs, hasher)
        if whole_offset is not None:  # packed once, for every rank that receives it whole
            destination = buffer[whole_offset : whole_offset + entry.nbytes]
            pack_entry(destination, entry, full, None if jobs else hasher)
        elif not jobs:
            _digest_entry(full, entry, hasher)

    def _post(self, bucket: BucketPlan, buffer: torch.Tensor) -> None:
        self._done.append(set())
        for rank, writes in zip(self._ranks, self._schedule.buckets[bucket.index], strict=True):
            area = self._schedule.area_offsets[bucket.index][rank.index]
            local, remote = writes.descriptors(
                buffer.data_ptr() + area, buffer.data_ptr(), self._inbox_slot(rank, bucket)
            )
            if not len(remote):
                self._done[bucket.index].add(rank.index)
                continue
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                rank.agent_name,
            )
            self._pending.append((bucket.index, rank, handle))
            if self._agent.transfer(handle) == "ERR":
                raise RuntimeError(
                    f"NIXL refused the write of bucket {bucket.index} to {rank.describe()}"
                )
            # no padding
            self.sent_bytes += sum(job.nbytes for job in writes.jobs) + writes.whole_nbytes

    def _inbox_slot(self, rank: Rank, bucket: BucketPlan) -> int:
        """Where bucket `bucket`'s slot of `rank`'s inbox starts (0: the rank has none)."""
        inbox = self._inboxes[rank.index]
        if inbox is None:
            return 0
        return inbox.address + (bucket.index % inbox.slots) * inbox.slot_bytes

    def _claim_inboxes(self, bucket: BucketPlan, deadline: float, progress: Progress) -> None:
        """Before `bucket` lands in a rank's inbox slot: until the rank released the bucket
        that slot held before."""
        for rank, writes in zip(self._ranks, self._schedule.buckets[bucket.index], strict=True):
            inbox = self._inboxes[rank.index]
            if not writes.whole or inbox is None:
                continue
            slot = bucket.index % inbox.slots
            previous = self._inbox_use[rank.index].get(slot)
            if previous is not None:
                self._wait_ack(rank, previous, deadline, progress)
            self._inbox_use[rank.index][slot] = bucket.index

    def _wait_ack(self, rank: Rank, bucket_index: int, deadline: float, progress: Progress) -> None:
        while (rank.group, rank.rank, bucket_index) not in self._acks:
            if (abandoned := self._hooks.abandoned()) is not None:
                raise ValueError(f"stopped writing: {abandoned}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{rank.describe()} did not release bucket {bucket_index} of its inbox in time"
                )
            before = list(self._next_notice)
            self._advance(progress)
            if not self._listen() and self._next_notice == before:
                time.sleep(POLL_PAUSE_S)

    def _poll(self) -> bool:
        """Collect finished WRITEs; True when any finished."""
        still, finished = [], False
        for bucket_index, rank, handle in self._pending:
            state = self._agent.check_xfer_state(handle)
            if state == "PROC":
                still.append((bucket_index, rank, handle))
                continue
            handle.release()
            if state != "DONE":
                self._pending = [item for item in self._pending if item[2] is not handle]
                raise RuntimeError(
                    f"NIXL write of bucket {bucket_index} to {rank.describe()} failed"
                )
            self._done[bucket_index].add(rank.index)
            finished = True
        self._pending = still
        return finished

    def _advance(self, progress: Progress) -> None:
        """Tell each rank, in bucket order, of the buckets whose WRITE to it completed."""
        self._poll()
        written = self._hooks.written
        for rank in self._ranks:
            index = self._next_notice[rank.index]
            while index < len(self._done) and rank.index in self._done[index]:
                digests, slices = self._notices[index]
                written(rank.index, index, digests, slices[rank.index])
                index += 1
            self._next_notice[rank.index] = index
        buckets = self._plan.buckets
        while self._reported < min(self._next_notice):
            progress(buckets[self._reported].payload_bytes)
            self._reported += 1

    def _wait_for(self, bucket_index: int, deadline: float, progress: Progress) -> None:
        """Until every rank was told of bucket `bucket_index` (and those before it)."""
        while min(self._next_notice, default=bucket_index + 1) <= bucket_index:
            if (abandoned := self._hooks.abandoned()) is not None:
                raise ValueError(f"stopped writing: {abandoned}")
            if time.monotonic() > deadline:
                late = sorted({rank.describe() for _, rank, _ in self._pending})
                raise TimeoutError(f"NIXL writes not complete in time: {', '.join(late)}")
            before = list(self._next_notice)
            self._advance(progress)
            if self._next_notice == before:
                time.sleep(POLL_PAUSE_S)
