"""`dist`: buckets travel on a torch.distributed gloo group spanning hosts.

The group (`dist_group.py`) is created once and reused: the publisher is group rank 0, every
engine rank a member. Per push, on the group, in order:

    UpdateBegin -> (BucketSent, bucket data) x buckets -> UpdateEnd

Messages are typed wire frames broadcast as `uint8` tensors (length first), never pickle.
Bucket data goes out as asynchronous operations from two send buffers, so packing bucket k+1
overlaps sending bucket k. Two modes:

- `broadcast`: one broadcast of the whole bucket; every rank receives every byte.
- `scatter`: each rank receives only the regions of the bucket it loads (its TP slices, from
  the `RankLayout` it reported when it joined), as a point-to-point send: 1/tp of the bytes for
  sharded tensors. Ranks with the same slice map share one packed buffer. No rank holds whole
  tensors, so per-tensor digests cannot be checked on the engine: the transport checks an
  xxh3-128 of each rank's bytes of every bucket instead, and engines run with `verify: none`.

`auto` picks `scatter` when every engine rank is part of a TP group (tp > 1), else `broadcast`.
A rank receives in a background thread, up to `prefetch_depth` buckets ahead of the Receiver.
"""

import logging
import queue
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from weightbus.digest import bytes_digest
from weightbus.plan import BucketPlan, Plan, plan_buckets
from weightbus.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.plan.bucket import BucketEntry, byte_view, check_entry_tensor, pack_entries
from weightbus.receiver.prefetch import Prefetcher
from weightbus.transport.base import (
    BucketSink,
    BucketSource,
    Progress,
    PushSession,
    ReceivedBatch,
    no_progress,
)
from weightbus.transport.dist_group import (
    DEFAULT_GROUP_NAME,
    WeightsGroup,
    broadcast_message,
    get_group,
    op_timeout,
    receive_broadcast_message,
    remaining_s,
    wait,
)
from weightbus.transport.slices import (
    check_slices,
    pack_regions,
    packed_offsets,
    rank_regions,
    unpack_regions,
)
from weightbus.wire import Message, ProtocolError, UpdateBegin, UpdateEnd
from weightbus.wire.messages import BucketSent, SliceSpec

logger = logging.getLogger(__name__)

Mode = Literal["auto", "broadcast", "scatter"]
MODES = ("auto", "broadcast", "scatter")
# Tag of point-to-point bucket data (scatter); layouts use another tag at group creation.
_DATA_TAG = 2
# Receive buffers besides the prefetch queue's: the one being received, the one the Receiver
# queued and the one it loads (when its prefetch thread holds one more, receiving waits).
_BUFFERS_BESIDES_PREFETCH = 3


def _slices(group: WeightsGroup, group_rank: int) -> dict[str, SliceSpec]:
    return {spec.name: spec for spec in group.layouts[group_rank].slices}


def choose_mode(group: WeightsGroup, mode: Mode) -> Literal["broadcast", "scatter"]:
    """The mode of a push: `mode` unless `auto`, which scatters when every rank has tp > 1."""
    if mode != "auto":
        return mode
    tp_sizes = [layout.tp_size for layout in group.layouts.values()]
    return "scatter" if tp_sizes and min(tp_sizes) > 1 else "broadcast"


@dataclass(slots=True)
class _ScatterTarget:
    """Ranks that load the same slices: one packed buffer serves them all."""

    slices: dict[str, SliceSpec]
    group_ranks: list[int]


def _scatter_targets(group: WeightsGroup) -> list[_ScatterTarget]:
    targets: dict[tuple, _ScatterTarget] = {}
    for group_rank in sorted(group.layouts):
        slices = _slices(group, group_rank)
        key = tuple(sorted(slices.items()))
        targets.setdefault(key, _ScatterTarget(slices, [])).group_ranks.append(group_rank)
    return list(targets.values())


class _InFlight:
    """Operations of one bucket not yet known complete, and the tensors they read."""

    def __init__(self) -> None:
        self.ops: list[tuple[object, torch.Tensor]] = []
        self.nbytes = 0

    def finish(self, group: WeightsGroup, deadline: float, what: str) -> int:
        for work, _ in self.ops:
            wait(group, work, deadline, what)
        nbytes, self.ops, self.nbytes = self.nbytes, [], 0
        return nbytes


class DistSink(BucketSink):
    """Publisher side of `dist` (the group must be initialised: `Publisher.init_weights_group`).

    Args:
        group_name: the weights group to push on.
        mode: `broadcast`, `scatter` or `auto`.
        prefetch_depth: buckets each rank receives ahead of the one it loads.

    Attributes:
        sent_bytes: bytes each receiving group rank got in the last push.
    """

    name = "dist"

    def __init__(
        self, group_name: str = DEFAULT_GROUP_NAME, mode: Mode = "auto", prefetch_depth: int = 1
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.group_name = group_name
        self.requested_mode = mode
        self.prefetch_depth = prefetch_depth
        self.sent_bytes: dict[int, int] = {}
        self._session_mode: tuple[str, str] = ("", "broadcast")

    def _group(self) -> WeightsGroup:
        group = get_group(self.group_name)
        group.check_usable()
        return group

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> dict:
        group = self._group()
        mode = choose_mode(group, self.requested_mode)
        if mode == "scatter":
            shapes = {meta.name: meta.shape for meta in session.plan.metas}
            for group_rank in group.layouts:
                check_slices(_slices(group, group_rank), shapes)
        self._session_mode = (session.session_id, mode)
        session.ensure_digests(tensors)  # each bucket's message carries its tensors' digests
        return {
            "group_name": self.group_name,
            "session_id": session.session_id,
            "mode": mode,
            "prefetch_depth": self.prefetch_depth,
        }

    @property
    def mode(self) -> str:
        return f"dist {self._session_mode[1]}"

    def receiver_verify(self, verify: str) -> str:
        # scatter: no rank holds whole tensors; the transport checks each rank's bytes
        return "none" if self._session_mode[1] == "scatter" else verify

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        group = self._group()
        session_id, mode = self._session_mode
        assert session_id == session.session_id, "prepare() the session first"
        push = _Push(group, session, tensors, time.monotonic() + timeout_s)
        try:
            push.run(mode, progress)
        except BaseException as exc:
            # the receivers are at some step of the stream: the group must be re-initialised
            group.broken = group.broken or f"a push failed midway: {exc}"
            raise
        finally:
            self.sent_bytes = push.sent_bytes

    def close(self) -> None:
        """Nothing to free: the group belongs to the Publisher, buffers to the group."""


class _Push:
    """One push on the group: `run` is a loop over `_send_bucket`, two buckets in flight."""

    def __init__(
        self,
        group: WeightsGroup,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        deadline: float,
    ) -> None:
        self.group = group
        self.session = session
        self.tensors = tensors
        self.deadline = deadline
        self.sent_bytes = dict.fromkeys(range(1, group.world_size), 0)
        self.in_flight = [_InFlight(), _InFlight()]  # double buffering: pack one, send one

    def run(self, mode: str, progress: Progress) -> None:
        group, deadline = self.group, self.deadline
        targets = _scatter_targets(group) if mode == "scatter" else None
        begin = broadcast_message(group, self.session.begin_message(), deadline)
        for bucket in self.session.plan.buckets:
            pending = self.in_flight[bucket.index % 2]
            progress(pending.finish(group, deadline, f"bucket {bucket.index - 2}"))
            self._send_bucket(bucket, pending, targets)
        for pending in self.in_flight:
            progress(pending.finish(group, deadline, "the last buckets"))
        end = broadcast_message(group, self.session.end_message(), deadline)
        for work, _ in [*begin, *end]:
            wait(group, work, deadline, "the session's messages")

    def _send_bucket(
        self, bucket: BucketPlan, pending: _InFlight, targets: list[_ScatterTarget] | None
    ) -> None:
        buffer = self.group.buffer(("send", bucket.index % 2), self.session.plan.bucket_bytes)
        message = BucketSent(
            session_id=self.session.session_id,
            bucket_index=bucket.index,
            digests=_completed_digests(self.session, bucket),
        )
        if targets is None:
            self._broadcast(bucket, buffer, message, pending)
        else:
            pack_entries(buffer, bucket.entries, self.tensors)
            self._scatter(bucket, buffer, targets, message, pending)
        pending.nbytes = bucket.nbytes

    def _entry_bytes(self, entry: BucketEntry, buffer: torch.Tensor) -> torch.Tensor:
        """The entry's bytes: a view of the source tensor when it is contiguous (no copy),
        else packed into the bucket buffer."""
        tensor = self.tensors.get(entry.name)
        if tensor is None or not tensor.is_contiguous() or tensor.device.type != "cpu":
            pack_entries(buffer, [entry], self.tensors)  # also raises for a missing tensor
            return buffer[entry.offset : entry.end]
        check_entry_tensor(entry, tensor)
        start = entry.tensor_offset
        return byte_view(tensor.detach())[start : start + entry.nbytes]

    def _broadcast(
        self, bucket: BucketPlan, buffer: torch.Tensor, message: BucketSent, pending: _InFlight
    ) -> None:
        # one collective per entry, straight from the tensors: no packing copy on this side,
        # and each lands at its place in the receivers' bucket buffers
        pending.ops += broadcast_message(self.group, message, self.deadline)
        timeout = op_timeout(self.deadline, f"broadcast of bucket {bucket.index}")
        for entry in bucket.entries:
            if entry.nbytes:
                data = self._entry_bytes(entry, buffer)
                pending.ops.append((self.group.pg.broadcast(data, 0, timeout), data))
        for group_rank in self.sent_bytes:
            self.sent_bytes[group_rank] += bucket.nbytes

    def _scatter(
        self,
        bucket: BucketPlan,
        buffer: torch.Tensor,
        targets: list[_ScatterTarget],
        message: BucketSent,
        pending: _InFlight,
    ) -> None:
        packed_buffers = []
        for index, target in enumerate(targets):
            packed = self.group.buffer(("packed", bucket.index % 2, index), buffer.numel())
            nbytes = pack_regions(rank_regions(bucket, buffer, target.slices), packed)
            packed_buffers.append(packed[:nbytes])
        sends = [
            (group_rank, packed)
            for target, packed in zip(targets, packed_buffers, strict=True)
            for group_rank in target.group_ranks
        ]
        digests = [bytes_digest(packed) for packed in packed_buffers]
        by_rank = {
            group_rank: digest
            for target, digest in zip(targets, digests, strict=True)
            for group_rank in target.group_ranks
        }
        message = msgspec.structs.replace(message, rank_digests=by_rank)
        pending.ops += broadcast_message(self.group, message, self.deadline)
        for group_rank, packed in sends:
            pending.ops.append((self.group.pg.send([packed], group_rank, _DATA_TAG), packed))
            self.sent_bytes[group_rank] += packed.numel()


def _completed_digests(session: PushSession, bucket: BucketPlan) -> dict[str, str]:
    # digests of the tensors whose last byte is in this bucket
    return {
        e.name: session.digests[e.name]
        for e in bucket.entries
        if e.tensor_offset + e.nbytes == e.tensor_nbytes
    }


class _BufferPool:
    """Receive buffers handed out to batches and returned by their `release()`."""

    def __init__(self, group: WeightsGroup, count: int, nbytes: int) -> None:
        self.buffers = [group.buffer(("recv", index), nbytes) for index in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(count):
            self._free.put(index)

    def acquire(self, deadline: float) -> int:
        try:
            return self._free.get(timeout=remaining_s(deadline, "a free receive buffer"))
        except queue.Empty:
            raise TimeoutError("no receive buffer was released in time") from None

    def release(self, index: int) -> None:
        self._free.put(index)


def _description_fields(description: dict) -> tuple[str, str, str, int]:
    try:
        name = description["group_name"]
        session_id = description["session_id"]
        mode = description["mode"]
        prefetch_depth = description.get("prefetch_depth", 1)
    except (KeyError, TypeError):
        raise ValueError(
            "dist source needs {'group_name', 'session_id', 'mode', 'prefetch_depth'}"
        ) from None
    if mode not in ("broadcast", "scatter"):
        raise ValueError(f"dist mode must be 'broadcast' or 'scatter', got {mode!r}")
    if not (isinstance(prefetch_depth, int) and 1 <= prefetch_depth <= 64):
        raise ValueError(f"dist prefetch_depth must be an integer in [1, 64], got {prefetch_depth}")
    return str(name), str(session_id), mode, prefetch_depth


class DistSource(BucketSource):
    """Engine-rank side of `dist` for one session, on the live group the description names."""

    def __init__(self, description: dict, *, rank: int = 0, tp_size: int = 1) -> None:
        name, self.session_id, self.mode, self.prefetch_depth = _description_fields(description)
        self.group = get_group(name)
        self.group.check_usable()
        self._plan: Plan | None = None
        self._ended = False

    def _recv(self, expected: type[Message], deadline: float) -> Message:
        message = receive_broadcast_message(self.group, deadline, f"a {expected.__name__}")
        if getattr(message, "session_id", None) != self.session_id:
            raise ProtocolError(
                f"{type(message).__name__} of session {getattr(message, 'session_id', None)} "
                f"arrived, expected session {self.session_id}"
            )
        if not isinstance(message, expected):
            raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
        return message

    def begin(self, timeout_s: float) -> UpdateBegin:
        header = self._recv(UpdateBegin, time.monotonic() + timeout_s)
        self._plan = plan_buckets((m.to_meta() for m in header.tensors), header.bucket_bytes)
        return header

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._plan is not None, "begin() first"
        deadline = time.monotonic() + timeout_s
        prefetcher = Prefetcher(self._receive(self._plan, deadline), self.prefetch_depth, "dist")
        try:
            while True:
                try:
                    batch = prefetcher.get(deadline - time.monotonic())
                except StopIteration:
                    return
                yield batch
        finally:
            prefetcher.close()

    def _receive(self, plan: Plan, deadline: float) -> Iterator[ReceivedBatch]:
        count = self.prefetch_depth + _BUFFERS_BESIDES_PREFETCH
        pool = _BufferPool(self.group, count, plan.bucket_bytes)
        assembler = ChunkAssembler(buffers=self.group.assembly_buffers)
        for bucket in plan.buckets:
            message = self._recv(BucketSent, deadline)
            if message.bucket_index != bucket.index:
                raise ProtocolError(
                    f"bucket {message.bucket_index} arrived, expected {bucket.index}"
                )
            index = pool.acquire(deadline)
            buffer = pool.buffers[index]
            if self.mode == "scatter":
                nbytes = self._receive_slices(bucket, buffer, message, deadline)
            else:
                nbytes = self._receive_whole(bucket, buffer, deadline)
            yield ReceivedBatch(
                tensors=list(unpack_bucket(bucket, buffer, assembler)),
                digests=dict(message.digests),
                nbytes=nbytes,
                release=lambda index=index: pool.release(index),
            )

    def _receive_whole(self, bucket: BucketPlan, buffer: torch.Tensor, deadline: float) -> int:
        what = f"bucket {bucket.index}"
        timeout = op_timeout(deadline, what)
        ops = [
            self.group.pg.broadcast(buffer[entry.offset : entry.end], 0, timeout)
            for entry in bucket.entries
            if entry.nbytes
        ]
        for work in ops:
            wait(self.group, work, deadline, what)
        return bucket.nbytes

    def _receive_slices(
        self, bucket: BucketPlan, buffer: torch.Tensor, message: BucketSent, deadline: float
    ) -> int:
        group = self.group
        regions = rank_regions(bucket, buffer, _slices(group, group.group_rank))
        _, nbytes = packed_offsets(regions)
        packed = group.buffer(("packed",), nbytes)
        wait(group, group.pg.recv([packed], 0, _DATA_TAG), deadline, f"bucket {bucket.index}")
        expected = message.rank_digests.get(group.group_rank)
        if expected is None or bytes_digest(packed) != expected:
            raise ValueError(f"bucket {bucket.index}: the bytes received are corrupted (digest)")
        unpack_regions(packed, regions)
        return nbytes

    def end(self, timeout_s: float) -> UpdateEnd:
        end = self._recv(UpdateEnd, time.monotonic() + timeout_s)
        self._ended = True
        return end

    def close(self) -> None:
        # a session left midway leaves this member at another step of the stream than the rest
        if not self._ended and self.group.broken is None:
            self.group.broken = "a push ended midway on this rank"
