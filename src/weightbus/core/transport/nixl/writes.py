"""A trainer rank's WRITEs of the tensors it sends whole: per bucket, pack every engine rank's
slices (and the entries one receives whole, into its inbox) into a send buffer, digesting them
as they pass; post one NIXL WRITE per engine rank; follow each to its end, in bucket order."""

import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from weightbus.core.digest import TensorHasher
from weightbus.core.plan import BucketPlan
from weightbus.core.plan.bucket import (
    BucketEntry,
    byte_view,
    check_entry_tensor,
    digest_part,
    nonfinite_row_check,
    pack_entry,
    pack_rows,
)
from weightbus.core.transport.base import Progress, no_progress
from weightbus.core.transport.nixl.agent import POLL_PAUSE_S, Agent, release
from weightbus.core.transport.nixl.schedule import Schedule, SliceJob, entry_rows
from weightbus.core.wire import DirectTarget


class NixlTarget(msgspec.Struct, frozen=True, kw_only=True):
    """One engine rank as its hello offered it: its agent (the metadata it sent last: its
    inbox's, when it offered one), where its memory starts, its parameters, its inbox."""

    group: int
    rank: int
    agent_name: str
    agent_metadata: bytes
    memory_address: int
    target: DirectTarget
    inbox: tuple[int, int, int] | None = None  # (address, slot bytes, slots)

    def describe(self) -> str:
        return f"engine {self.group} rank {self.rank}"


@dataclass(frozen=True, kw_only=True)
class WriteHooks:
    """What the leader's sink lends its own sender in a group of one (`RankWork.hooks`), to
    talk to the engine ranks as the WRITEs go (the defaults tell and hear nothing).

    Attributes:
        written: `(rank index, bucket index, digests, slice digests)`: that engine rank's
            WRITE of the bucket completed (called in bucket order, once per rank and bucket).
        progress: each bucket's payload bytes, once every rank was told of it.
        acks: `(group, rank, bucket)` of the inbox slots released, filled by `listen`; None:
            no inbox can be used.
        listen: takes the engine ranks' messages already here; True when any came.
        abandoned: why the stream stopped (an engine answered), or None.
        deadline: `time.monotonic()` by which the stream must end.
    """

    written: Callable[[int, int, dict[str, str], dict[str, str]], None] = lambda *_: None
    progress: Progress = no_progress
    acks: set[tuple[int, int, int]] | None = None
    listen: Callable[[], bool] = lambda: False
    abandoned: Callable[[], str | None] = lambda: None
    deadline: float = math.inf


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


def _slice_shape(shape: tuple[int, ...], job: SliceJob) -> tuple[int, ...]:
    """The shape of the slice `job` packs rows of (the whole tensor's, narrowed)."""
    if not shape:
        return shape
    copy = job.copy.copy
    return (*shape[: copy.src_dim], copy.length, *shape[copy.src_dim + 1 :])


class BucketWrites:
    """A rank's WRITEs of `tensors` (`schedule.sends`, by name) in one session, with `agent`
    (every engine rank's agent loaded) into `targets` (schedule order) as `schedule` says:
    bucket b packs into `buffers[b % len(buffers)]` (registered, `schedule.slot_bytes` at
    least), each engine rank's slices digested too with `verify`, each chunk refused if it
    holds NaN/inf with `refuse_nonfinite` (as it is packed, before its WRITE); `hooks`: the
    leader's sink's, in a group of one.

    Raises:
        ValueError: an engine rank receives tensors whole and offered no inbox large enough,
            or no inbox can be used (`hooks.acks` is None).

    Attributes:
        digests: the digest of every tensor written so far, by name.
        slice_digests: per engine rank, the digests of its slices written so far.
        rank_bytes: per engine rank, the bytes written into it.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        tensors: Mapping[str, torch.Tensor],
        targets: list[NixlTarget],
        schedule: Schedule,
        buffers: list[torch.Tensor],
        verify: bool,
        refuse_nonfinite: bool = False,
        hooks: WriteHooks | None = None,
    ) -> None:
        self._agent, self._plan, self._tensors = agent, schedule.plan, tensors
        self._targets, self._schedule, self._buffers = targets, schedule, buffers
        self._verify, self._refuse_nonfinite = verify, refuse_nonfinite
        self._hooks = WriteHooks() if hooks is None else hooks
        for rank, need in zip(targets, schedule.inbox_bytes, strict=True):
            if need and self._hooks.acks is None:
                raise ValueError(
                    f"{rank.describe()} receives tensors whole (not its parameters): only a "
                    "trainer group of one sends such tensors over nixl"
                )
            if need and (rank.inbox is None or rank.inbox[1] < need):
                raise ValueError(
                    f"{rank.describe()} receives tensors whole and offered no inbox of {need} bytes"
                )
        # per rank: inbox slot -> the last bucket written into it
        self._inbox_use: list[dict[int, int]] = [{} for _ in targets]
        self._metas = {meta.name: meta for meta in self._plan.metas}
        # a non-contiguous tensor split across buckets is made contiguous once, not per bucket
        self._contiguous: dict[str, torch.Tensor] = {}
        self._full_hashers: dict[str, Any] = {}
        self._slice_hashers: dict[tuple[str, int], Any] = {}
        self._pending: list[tuple[Any, str, int, int]] = []  # (handle, what, bucket, rank)
        self._done: list[set[int]] = []  # per posted bucket: the rank indices written
        self._notices: list[tuple[dict[str, str], list[dict[str, str]]]] = []
        self._next_notice = [0] * len(targets)
        self._reported = 0  # buckets reported to `progress`
        self._deadline = 0.0
        self.digests: dict[str, str] = {}
        self.slice_digests: list[dict[str, str]] = [{} for _ in targets]
        self.rank_bytes = [0] * len(targets)

    def run(self, pool: ThreadPoolExecutor, deadline: float) -> None:
        """Write every bucket; return once every WRITE completed (and, with hooks, every rank
        was told of every bucket).

        Raises:
            TimeoutError: a WRITE did not complete by `deadline` (it names the rank).
            RuntimeError: NIXL failed a WRITE (it names the rank).
            ValueError: a tensor does not match the plan, or the push was abandoned.
        """
        self._deadline = deadline
        buckets = self._plan.buckets
        depth = len(self._buffers)
        # bucket k+1 packs while bucket k is posted: on one host a WRITE is a CMA copy made
        # inside `transfer`, so packing after it would leave the copies in series
        with ThreadPoolExecutor(1, thread_name_prefix="nixl-packer") as packer:
            try:
                packed = self._start_pack(packer, pool, buckets[0])
                for bucket, following in zip(buckets, [*buckets[1:], None], strict=True):
                    packed.result(max(0.0, deadline - time.monotonic()))
                    if following is not None and depth > 1:  # its buffer is not this one's
                        packed = self._start_pack(packer, pool, following)
                    self._claim_inboxes(bucket)
                    self._post(bucket, self._buffers[bucket.index % depth])
                    self._advance()
                    if following is not None and depth == 1:
                        packed = self._start_pack(packer, pool, following)
                self._wait_for(len(buckets) - 1)
            finally:
                for handle, *_ in self._pending:
                    release(handle)

    def _start_pack(
        self, packer: ThreadPoolExecutor, pool: ThreadPoolExecutor, bucket: BucketPlan
    ) -> Future:
        """Pack `bucket` on the packer thread, once the bucket that used its buffer before
        was written everywhere."""
        depth = len(self._buffers)
        if bucket.index >= depth:
            self._wait_for(bucket.index - depth)
        return packer.submit(self._pack, pool, bucket, self._buffers[bucket.index % depth])

    def _pack(self, pool: ThreadPoolExecutor, bucket: BucketPlan, buffer: torch.Tensor) -> None:
        by_name: dict[str, list[tuple[SliceJob, torch.Tensor, Any]]] = {}
        whole: dict[str, int] = {}  # where an entry some rank receives whole is packed, once
        for index, writes in enumerate(self._schedule.buckets[bucket.index]):
            for job in writes.jobs:
                by_name.setdefault(job.name, []).append(
                    self._destination(index, job, buffer, writes.area)
                )
            for whole_job in writes.whole:
                whole[whole_job.entry.name] = whole_job.packed_offset
                self.rank_bytes[index] += whole_job.entry.nbytes
        sent = self._schedule.sends
        futures = [
            pool.submit(
                self._pack_one, entry, by_name.get(entry.name, []), buffer, whole.get(entry.name)
            )
            for entry in sorted(bucket.entries, key=lambda entry: -entry.nbytes)
            if entry.name in sent
        ]
        for future in futures:
            future.result(max(0.0, self._deadline - time.monotonic()))
        finished = [name for name in bucket.finished_names() if name in sent]
        for name in finished:
            self._contiguous.pop(name, None)
        digests = {name: self._full_hashers.pop(name).hexdigest() for name in finished}
        self.digests.update(digests)
        slices = [
            {
                name: self._slice_hashers.pop((name, index)).hexdigest()
                for name in finished
                if (name, index) in self._slice_hashers
            }
            for index in range(len(self._targets))
        ]
        for found, kept in zip(slices, self.slice_digests, strict=True):
            kept.update(found)
        self._notices.append((digests, slices))

    def _destination(self, index: int, job: SliceJob, buffer: torch.Tensor, area: int):
        full = self._tensors[job.name]
        start = area + job.packed_offset
        shape = job.source(full).shape
        destination = buffer[start : start + job.nbytes].view(full.dtype).view(shape)
        hasher = None
        if self._verify:
            key = (job.name, index)
            hasher = self._slice_hashers.get(key)
            if hasher is None:  # the digest of the region the rank re-reads: its slice's shape
                hasher = self._slice_hashers[key] = TensorHasher.of_shape(
                    _slice_shape(self._metas[job.name].shape, job), full.element_size()
                )
        self.rank_bytes[index] += job.nbytes
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
        refuse = self._refuse_nonfinite
        if jobs:  # every rank's slices of the entry's rows, digested with the full rows
            rows = entry_rows(self._metas[entry.name], entry, self._plan.bucket_bytes)
            parts = [*(_slice_part(full, *job) for job in jobs), digest_part(full, hasher)]
            pack_rows(*rows, parts, nonfinite_row_check(entry.name, full) if refuse else None)
        if whole_offset is not None:  # packed once, for every rank that receives it whole
            destination = buffer[whole_offset : whole_offset + entry.nbytes]
            hasher = None if jobs else hasher
            pack_entry(destination, entry, full, hasher, refuse_nonfinite=refuse and not jobs)
        elif not jobs:  # digested in place: nothing to copy
            start = entry.tensor_offset
            hasher.update(byte_view(full)[start : start + entry.nbytes].numpy())

    def _post(self, bucket: BucketPlan, buffer: torch.Tensor) -> None:
        self._done.append(set())
        writes_of = self._schedule.buckets[bucket.index]
        for index, (rank, writes) in enumerate(zip(self._targets, writes_of, strict=True)):
            inbox = 0  # where bucket's slot of the rank's inbox starts
            if rank.inbox is not None:
                address, slot_bytes, slots = rank.inbox
                inbox = address + (bucket.index % slots) * slot_bytes
            base = buffer.data_ptr()
            local, remote = writes.descriptors(base + writes.area, base, inbox)
            if not len(remote):
                self._done[bucket.index].add(index)
                continue
            what = f"bucket {bucket.index} to {rank.describe()}"
            handle = self._agent.write(local, remote, rank.agent_name, what)
            self._pending.append((handle, what, bucket.index, index))

    def _claim_inboxes(self, bucket: BucketPlan) -> None:
        """Before `bucket` lands in a rank's inbox slot: until the rank released the bucket
        that slot held before."""
        writes_of = self._schedule.buckets[bucket.index]
        for rank, writes, used in zip(self._targets, writes_of, self._inbox_use, strict=True):
            if not writes.whole or rank.inbox is None:
                continue
            slot = bucket.index % rank.inbox[2]
            if (previous := used.get(slot)) is not None:
                self._wait_ack(rank, previous)
            used[slot] = bucket.index

    def _wait_ack(self, rank: NixlTarget, bucket_index: int) -> None:
        acks = self._hooks.acks
        assert acks is not None  # checked: a rank with an inbox hears acks
        self._until(
            lambda: (rank.group, rank.rank, bucket_index) in acks,
            lambda: f"{rank.describe()} did not release bucket {bucket_index} of its inbox in time",
            listen=True,
        )

    def _wait_for(self, bucket_index: int) -> None:
        """Until every rank was told of bucket `bucket_index` (and those before it)."""
        self._until(
            lambda: min(self._next_notice, default=bucket_index + 1) > bucket_index,
            lambda: (
                "NIXL writes not complete in time: "
                + ", ".join(sorted({self._targets[i].describe() for *_, i in self._pending}))
            ),
        )

    def _until(
        self, done: Callable[[], bool], late: Callable[[], str], *, listen: bool = False
    ) -> None:
        """Follow the WRITEs until `done()` (with `listen`, hearing the engine ranks too: only
        for an ack, as a look at the socket per pause slows the writes).

        Raises:
            ValueError: the push was abandoned.
            TimeoutError: not done by the deadline (`late()` says what is late).
        """
        while not done():
            if (abandoned := self._hooks.abandoned()) is not None:
                raise ValueError(f"stopped writing: {abandoned}")
            if time.monotonic() > self._deadline:
                raise TimeoutError(late())
            before = list(self._next_notice)
            self._advance()
            heard = listen and self._hooks.listen()
            if not heard and self._next_notice == before:
                time.sleep(POLL_PAUSE_S)

    def _advance(self) -> None:
        """Tell each rank, in bucket order, of the buckets whose WRITE to it completed."""
        for _, _, bucket_index, index in self._agent.reap(self._pending):
            self._done[bucket_index].add(index)
        written = self._hooks.written
        for rank in range(len(self._targets)):
            index = self._next_notice[rank]
            while index < len(self._done) and rank in self._done[index]:
                digests, slices = self._notices[index]
                written(rank, index, digests, slices[rank])
                index += 1
            self._next_notice[rank] = index
        buckets = self._plan.buckets
        while self._reported < min(self._next_notice):
            self._hooks.progress(buckets[self._reported].payload_bytes)
            self._reported += 1
