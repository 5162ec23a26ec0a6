"""One sharded push over `dist`, as every trainer rank runs it: every trainer rank is a member
of the weights group (group ranks `0 .. T-1`, the engines' ranks after them) and sends each
engine rank the parts of its regions it holds (`dist_parts.bucket_parts`), point to point.

Rank 0 broadcasts the session's messages as a lone publisher does (`UpdateBegin`, a
`BucketSent` per bucket naming every part's sender, `UpdateEnd`); the other ranks take part in
those broadcasts and send their parts of a bucket once its `BucketSent` arrives, two buckets in
flight. Each payload ends with its sender's xxh3-128, which the engine rank checks. First the
ranks compute the tensors' digests together (`digests.compute`, no gather), which rank 0's
messages carry as a lone publisher's do. A rank that fails aborts its membership, so every
peer's pending operation ends at once.
"""

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from weightbus.core.plan import Plan
from weightbus.core.sharded.control import GroupControl, TrainerRankError
from weightbus.core.sharded.digests import (
    DigestPlan,
    collected,
    compute,
    whole_regions,
)
from weightbus.core.sharded.dist_parts import (
    BucketParts,
    SendPart,
    bucket_parts,
    parts_hash,
)
from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.schedule import cell_view
from weightbus.core.sharded.write import COMPILED_KEPT
from weightbus.core.transport.base import PushSession
from weightbus.core.transport.distributed.group import (
    DATA_TAG,
    WeightsGroup,
    broadcast_message,
    destroy_group,
    get_group,
    join_group,
    receive_broadcast_message,
    wait,
)
from weightbus.core.transport.distributed.parts import (
    PART_DIGEST_BYTES,
    aligned_offsets,
    payload_digest,
)
from weightbus.core.transport.distributed.sink import completed_digests
from weightbus.core.transport.distributed.slices import SliceTarget, slice_targets
from weightbus.core.wire import Message, ProtocolError, UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import BucketSent, RankLayout

_BUFFER_ROUNDING = 1 << 20  # send buffers grow in MiB steps (reused across buckets)


class JoinOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's order to join the weights group it is forming."""

    group_name: str
    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float


class DistOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's order to send a session: the engine ranks' slice maps and the plan."""

    group_name: str
    session_id: str
    bucket_bytes: int
    plan_hash: str
    layouts: list[RankLayout]


class SendReport(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's parts sent: the parts it followed (their hash) and their bytes."""

    parts_hash: str
    sent_bytes: int


@dataclass(frozen=True)
class _Compiled:
    plan: Plan
    targets: list[SliceTarget]
    parts: BucketParts
    parts_hash: str
    digest_plan: DigestPlan


Progress = Callable[[int], None]


class GroupDist:
    """A trainer rank's side of sharded `dist` pushes (schedules kept while unchanged)."""

    def __init__(self, control: GroupControl) -> None:
        self._control = control
        self._compiled: dict[tuple, _Compiled] = {}
        self._joined: set[str] = set()

    def join(self, key: str, order: JoinOrder) -> None:
        """A rank other than 0: join the group rank 0 forms, and report (`key`)."""

        def work() -> bytes:
            join_group(
                name=order.group_name,
                master_addr=order.master_addr,
                master_port=order.master_port,
                group_rank=self._control.rank,
                world_size=order.world_size,
                timeout_s=order.timeout_s,
                layout=None,
                senders=self._control.world_size,
            )
            self._joined.add(order.group_name)
            return b""

        self._control.answer(key, work)

    def run(
        self,
        key: str,
        order: DistOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
        *,
        session: PushSession | None = None,
        progress: Progress = lambda nbytes: None,
    ) -> list[int] | None:
        """Digest this rank's blocks, send its parts of every bucket, reporting each (`key`);
        rank 0 (with the `session`) combines the digests, broadcasts the session's messages
        and returns the bytes each rank sent. A failure is reported, the group aborted, then
        raised."""
        group = get_group(order.group_name)
        try:
            return self._run(
                group, key, order=order, layout=layout, holdings=holdings, deadline=deadline,
                session=session, progress=progress,
            )  # fmt: skip
        except BaseException as exc:
            abort(group, f"a push failed midway: {type(exc).__name__}: {exc}")
            raise

    def _run(
        self,
        group: WeightsGroup,
        key: str,
        *,
        order: DistOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
        session: PushSession | None,
        progress: Progress,
    ) -> list[int] | None:
        compiled = self._compile(layout, order)

        def digests() -> bytes:
            blocks = compute(compiled.digest_plan, holdings, self._control, key, deadline)
            return msgspec.msgpack.encode(blocks)

        def send() -> bytes:
            sender = _Sender(group, compiled, holdings, deadline, order.session_id)
            sent = sender.run(session, progress)
            return msgspec.msgpack.encode(
                SendReport(parts_hash=compiled.parts_hash, sent_bytes=sent)
            )

        self._control.answer(f"{key}/digests", digests)
        if session is not None:
            session.digests.update(
                collected(compiled.digest_plan, self._control, f"{key}/digests", deadline)
            )
        self._control.answer(key, send)
        if session is None:
            _expect(group, UpdateEnd, order.session_id, deadline)
            return None
        sent = self._sent(group, key, compiled, deadline)
        for work, _ in broadcast_message(group, session.end_message(), deadline):
            wait(group, work, deadline, "the session's UpdateEnd")
        return sent

    def _sent(
        self, group: WeightsGroup, key: str, compiled: "_Compiled", deadline: float
    ) -> list[int]:
        """Rank 0: the bytes each rank sent, once every rank reported.

        Raises:
            TrainerRankError: a rank failed, did not report, or followed other parts (named).
        """
        # a broken group (an engine failed mid-stream: rank 0 aborted) ends the wait at once
        reports = self._control.collect(key, "sent parts", deadline, interrupt=lambda: group.broken)
        sent = []
        for rank in sorted(reports):
            report = msgspec.msgpack.decode(reports[rank].body, type=SendReport)
            if report.parts_hash != compiled.parts_hash:
                raise TrainerRankError(f"trainer rank {rank} computed other parts than rank 0")
            sent.append(report.sent_bytes)
        return sent

    def close(self) -> None:
        """Leave the groups this rank joined (rank 0's sink leaves its own)."""
        for name in self._joined:
            destroy_group(name)
        self._joined.clear()

    def _compile(self, layout: TrainerLayout, order: DistOrder) -> _Compiled:
        key = (layout.layout_hash, order.plan_hash, msgspec.msgpack.encode(order.layouts))
        if key not in self._compiled:
            plan = layout.plan(order.bucket_bytes, order.plan_hash)
            targets = slice_targets(order.layouts)
            parts = bucket_parts(layout, plan, targets)
            digests = DigestPlan(layout, whole_regions(layout))
            if len(self._compiled) >= COMPILED_KEPT:
                self._compiled.clear()
            self._compiled[key] = _Compiled(
                plan, targets, parts, parts_hash(layout, parts), digests
            )
        return self._compiled[key]


def abort(group: WeightsGroup, why: str) -> None:
    """End this member's part in the group now: every peer's pending operation fails at once
    (the group must be formed again)."""
    group.broken = group.broken or why
    group.pg.abort()


def _expect(group: WeightsGroup, kind: type[Message], session_id: str, deadline: float) -> Message:
    message = receive_broadcast_message(group, deadline, f"a {kind.__name__}")
    if not isinstance(message, kind) or getattr(message, "session_id", None) != session_id:
        raise ProtocolError(f"expected a {kind.__name__} of session {session_id}, got {message!r}")
    return message


class _Sender:
    """One rank's sends of one session, two buckets in flight."""

    def __init__(
        self,
        group: WeightsGroup,
        compiled: _Compiled,
        holdings: dict[str, Holding],
        deadline: float,
        session_id: str,
    ) -> None:
        self.group, self.compiled, self.holdings = group, compiled, holdings
        self.deadline, self.session_id = deadline, session_id
        self.session: PushSession | None = None
        self.progress: Progress = lambda nbytes: None
        self.rank = group.group_rank
        self.element_bytes = {meta.name: meta.element_bytes for meta in compiled.plan.metas}
        self.in_flight: list[list[tuple[object, torch.Tensor]]] = [[], []]
        self.payload_bytes = [0, 0]

    def run(self, session: PushSession | None, progress: Progress) -> int:
        """Send every bucket (rank 0, with the `session`: and its messages); the tensor bytes
        this rank sent."""
        self.session, self.progress = session, progress
        begin = []
        if session is not None:
            begin = broadcast_message(self.group, session.begin_message(), self.deadline)
        else:
            _expect(self.group, UpdateBegin, self.session_id, self.deadline)
        sent = 0
        for bucket in self.compiled.plan.buckets:
            ops = self._announce(bucket.index)
            slot = bucket.index % 2
            self._finish(slot, f"bucket {bucket.index - 2}")
            sends, nbytes = self._send_bucket(bucket.index)
            self.in_flight[slot] = ops + sends
            self.payload_bytes[slot] = bucket.payload_bytes
            sent += nbytes
        for slot in (0, 1):
            self._finish(slot, "the last buckets")
        for work, _ in begin:
            wait(self.group, work, self.deadline, "the session's UpdateBegin")
        return sent

    def _announce(self, index: int) -> list:
        parts = self.compiled.parts[index]
        if self.session is None:
            _expect_bucket(self.group, self.session_id, index, self.deadline)
            return []
        by_rank = {
            group_rank: [part.part for part in target_parts]
            for target, target_parts in zip(self.compiled.targets, parts, strict=True)
            for group_rank in target.group_ranks
        }
        message = BucketSent(
            session_id=self.session.session_id,
            bucket_index=index,
            digests=completed_digests(self.session, self.compiled.plan.buckets[index]),
            parts=by_rank,
        )
        return broadcast_message(self.group, message, self.deadline)

    def _finish(self, slot: int, what: str) -> None:
        for work, _ in self.in_flight[slot]:
            wait(self.group, work, self.deadline, what)
        self.in_flight[slot] = []
        if self.session is not None and self.payload_bytes[slot]:
            self.session.count_sent(self.payload_bytes[slot])
            self.progress(self.payload_bytes[slot])
        self.payload_bytes[slot] = 0

    def _send_bucket(self, index: int) -> tuple[list, int]:
        """Post this rank's payload of bucket `index` to every engine rank; its tensor bytes."""
        ops, sent = [], 0
        for number, (target, parts) in enumerate(
            zip(self.compiled.targets, self.compiled.parts[index], strict=True)
        ):
            mine = [part for part in parts if part.part.src == self.rank]
            if not mine:
                continue
            payload, nbytes = self._pack(mine, ("send", index % 2, number))
            for group_rank in target.group_ranks:
                ops.append((self.group.pg.send([payload], group_rank, DATA_TAG), payload))
                sent += nbytes
        return ops, sent

    def _pack(self, parts: list[SendPart], key: tuple) -> tuple[torch.Tensor, int]:
        sizes = [part.numel * self.element_bytes[part.name] for part in parts]
        offsets, end = aligned_offsets(sizes)
        total = end + PART_DIGEST_BYTES
        rounded = -(-total // _BUFFER_ROUNDING) * _BUFFER_ROUNDING
        payload = self.group.buffer(key, rounded)[:total]
        for part, offset, size in zip(parts, offsets, sizes, strict=True):
            holding = self.holdings[part.name]
            destination = payload[offset : offset + size]
            if part.cell is None:  # a chunk of bytes
                destination.copy_(torch.from_numpy(holding.bytes_of(part.start, part.numel)))
                continue
            local = holding.local.view(holding.box.rows, holding.box.cols)
            source = cell_view(local, holding.box, part.cell)
            destination.view(local.dtype).view(part.cell.rows, part.cell.cols).copy_(source)
        payload[end:] = payload_digest(payload, end)
        return payload, sum(sizes)


def _expect_bucket(group: WeightsGroup, session_id: str, index: int, deadline: float) -> None:
    message = _expect(group, BucketSent, session_id, deadline)
    if message.bucket_index != index:
        raise ProtocolError(f"BucketSent of bucket {message.bucket_index}, expected {index}")
