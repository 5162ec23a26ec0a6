"""`dist` on every trainer rank (`DistRankSender`): the orders the leader's sink hands every
rank (`Sending.everyone`), their reports, and one session's sends (`SessionRun`): the leader
broadcasts the session's messages, the others take part in those collectives; every rank sends
its data as asynchronous operations, two buckets in flight. In a group of N, a rank that fails
a session aborts its membership, so every peer's pending operation ends at once.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import BucketEntry, byte_view, check_entry_tensor, pack_entries
from weightbus.core.trainer.cells import cell_view
from weightbus.core.trainer.digests import RankDigests, digest_share
from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.transport.base import Progress, PushSession
from weightbus.core.transport.distributed.group import (
    DATA_TAG,
    WeightsGroup,
    abort,
    broadcast_message,
    destroy_group,
    expect_message,
    get_group,
    join_group,
    op_timeout,
    wait,
)
from weightbus.core.transport.distributed.schedule import (
    BucketParts,
    SendPart,
    bucket_parts,
    parts_hash,
)
from weightbus.core.transport.distributed.slices import (
    PART_DIGEST_BYTES,
    SliceTarget,
    aligned_offsets,
    payload_digest,
    slice_targets,
)
from weightbus.core.transport.sending import RankSender, RankWork
from weightbus.core.wire import Message, ProtocolError, UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import BucketSent, RankLayout, SentPart

_BUFFER_ROUNDING = 1 << 20  # payload buffers grow in MiB steps (reused across buckets)
_PLANS_KEPT = 8  # parts plans kept: engines that come and go, sibling groups
# How long the leader waits, after a failed step, for the other ranks to say why they stopped.
CAUSE_WAIT_S = 1.0


class JoinOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Join the weights group the leader forms (its store at `master_addr:master_port`)."""

    group_name: str
    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float


class DigestOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Digest your share of the round's tensors."""


class SessionOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Send your part of session `session_id` on group `group_name`, within `timeout_s`, for
    engine ranks of `layouts`; in parts mode, a rank whose schedule is not the leader's
    (`parts_hash`) refuses before anything moves."""

    group_name: str
    session_id: str
    mode: str
    bucket_bytes: int
    plan_hash: str
    timeout_s: float
    layouts: list[RankLayout] = []
    parts_hash: str = ""


class Joined(msgspec.Struct, frozen=True, tag=True):
    """This rank joined the group."""


class DigestReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """This rank's share of the digests."""

    digests: RankDigests


class SessionReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """This rank's part of a session sent: its tensor bytes (summed over the engine ranks) and
    the bytes each engine group rank got from it (alignment padding included)."""

    sent_bytes: int
    rank_bytes: dict[int, int]


def failed_ranks(group: TrainerGroup, key: str) -> dict[int, str | None]:
    """Leader, after a failed step `key`: each other trainer rank that failed it (its error) or
    sent no report within `CAUSE_WAIT_S` (None: dead?)."""
    return group.failures(f"{key}/done", group.others, time.monotonic() + CAUSE_WAIT_S)


@dataclass
class LeaderPart:
    """The sink's hooks for the leader's sender in a session: the session whose messages it
    broadcasts, the push's progress, and `key`, the session's step on the trainer group (set
    as it starts: after a failure, the sink asks the other ranks' reports there)."""

    session: PushSession
    progress: Progress
    key: str = ""


@dataclass(frozen=True)
class PartsPlan:
    """This trainer rank's parts of a session, per bucket and target; `wire[bucket]`: what
    each engine group rank is told it receives from whom (the same on every trainer rank)."""

    plan: Plan
    targets: list[SliceTarget]
    mine: BucketParts
    wire: list[dict[int, list[SentPart]]]


class DistRankSender(RankSender):
    """A trainer rank's side of `dist` (parts plans kept while the layouts are unchanged)."""

    order_type = JoinOrder | DigestOrder | SessionOrder
    report_type = Joined | DigestReport | SessionReport

    def __init__(self, group: TrainerGroup) -> None:
        super().__init__(group)
        self._plans: dict[tuple, tuple[PartsPlan, str]] = {}
        self._joined: set[str] = set()

    def run(self, order: Any, work: RankWork) -> Any:
        if isinstance(order, JoinOrder):
            return self._join(order, work)
        if isinstance(order, DigestOrder):
            key = f"{work.key}/digests"
            share = digest_share(dict(work.holdings), work.layout, work.group, key, work.deadline)
            return DigestReport(digests=share)
        assert isinstance(order, SessionOrder)
        return self._send(order, work)

    def _join(self, order: JoinOrder, work: RankWork) -> Joined:
        """The leader runs its sink's part of forming the group (its hooks: the engines and
        itself join); the others join as the group's ranks 1 .. T-1."""
        if work.hooks is not None:
            work.hooks(work)
            return Joined()
        join_group(
            name=order.group_name,
            master_addr=order.master_addr,
            master_port=order.master_port,
            group_rank=self.group.rank,
            world_size=order.world_size,
            timeout_s=order.timeout_s,
            layout=None,
            senders=self.group.world_size,
        )
        self._joined.add(order.group_name)
        return Joined()

    def parts_plan(self, layout: TrainerLayout, order: SessionOrder) -> tuple[PartsPlan, str]:
        """The parts of a session in parts mode and their hash ("" in a group of one: nobody
        to agree with), kept per layout, plan and engine ranks."""
        key = (layout.layout_hash, order.plan_hash, msgspec.msgpack.encode(order.layouts))
        found = self._plans.get(key)
        if found is None:
            plan = layout.plan(order.bucket_bytes, order.plan_hash)
            targets = slice_targets(order.layouts)
            parts = bucket_parts(layout, plan, targets)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            hashed = parts_hash(layout, parts) if self.group.world_size > 1 else ""
            rank = self.group.rank
            mine = [[[p for p in target if p.part.src == rank] for target in b] for b in parts]
            wire = [
                {
                    group_rank: [send.part for send in target_parts]
                    for target, target_parts in zip(targets, bucket, strict=True)
                    for group_rank in target.group_ranks
                }
                for bucket in parts
            ]
            found = PartsPlan(plan, targets, mine, wire), hashed
            self._plans[key] = found
        return found

    def _send(self, order: SessionOrder, work: RankWork) -> SessionReport:
        group = get_group(order.group_name)
        try:
            return self._session(group, order, work)
        except BaseException as exc:
            if self.group.world_size > 1:  # the peers waiting on this rank stop at once
                abort(group, f"a push failed midway on trainer rank {self.group.rank}: {exc}")
            raise

    def _session(self, group: WeightsGroup, order: SessionOrder, work: RankWork) -> SessionReport:
        leader: LeaderPart | None = work.hooks
        if leader is not None:
            leader.key = work.key
        deadline = min(work.deadline, time.monotonic() + order.timeout_s)
        parts = None
        if order.mode == "parts":
            parts, hashed = self.parts_plan(work.layout, order)
            if hashed != order.parts_hash:
                raise ValueError(f"trainer rank {self.group.rank} computed other parts than rank 0")
        elif leader is None:  # broadcast: only the leader of a group of one sends
            raise ValueError(f"trainer rank {self.group.rank} cannot send in {order.mode} mode")
        run = SessionRun(
            group,
            session_id=order.session_id,
            holdings=work.holdings,
            deadline=deadline,
            parts=parts,
            pack=self._pack,
            leader=leader,
        )
        run.run()
        if leader is not None and self.group.world_size > 1:
            # the others' reports: a group broken under this rank (an engine failed, a peer
            # aborted) ends the wait at once
            work.group.collect(
                f"{work.key}/done",
                "part of the dist session",
                deadline,
                work.group.others,
                interrupt=lambda: group.broken,
            )
        return SessionReport(sent_bytes=run.sent_bytes, rank_bytes=run.rank_bytes)

    def _pack(
        self, run: "SessionRun", parts: list[SendPart], key: tuple
    ) -> tuple[torch.Tensor, int]:
        """This rank's `parts` of one payload of `run`, back to back, then their xxh3-128; the
        payload and its tensor bytes."""
        holdings = run.holdings
        sizes = [part.numel * holdings[part.name].meta.element_bytes for part in parts]
        offsets, end = aligned_offsets(sizes)
        total = end + PART_DIGEST_BYTES
        rounded = -(-total // _BUFFER_ROUNDING) * _BUFFER_ROUNDING
        payload = run.group.buffer(key, rounded)[:total]
        for part, offset, size in zip(parts, offsets, sizes, strict=True):
            holding = holdings[part.name]
            destination = payload[offset : offset + size]
            if part.cell is None:  # a run of elements, as raw bytes
                destination.copy_(torch.from_numpy(holding.bytes_of(part.start, part.numel)))
                continue
            source = cell_view(holding.matrix(), holding.box, part.cell)
            destination.view(source.dtype).view(part.cell.rows, part.cell.cols).copy_(source)
        payload[end:] = payload_digest(payload, end)
        return payload, sum(sizes)

    def close(self) -> None:
        """Leave the groups this rank joined (the leader's sink leaves its own)."""
        for name in self._joined:
            destroy_group(name)
        self._joined.clear()


class SessionRun:
    """One rank's sends of one session from its `holdings`: in parts mode its `parts` (packed
    by `pack`), in broadcast mode (`parts` None) every entry of the `leader`'s session."""

    def __init__(
        self,
        group: WeightsGroup,
        *,
        session_id: str,
        holdings: Mapping[str, Holding],
        deadline: float,
        parts: PartsPlan | None,
        pack: Callable[["SessionRun", list[SendPart], tuple], tuple[torch.Tensor, int]],
        leader: LeaderPart | None,
    ) -> None:
        self.group, self.session_id = group, session_id
        self.plan = parts.plan if parts is not None else leader.session.plan
        self.holdings, self.deadline = holdings, deadline
        self.tensors = {name: holding.tensor for name, holding in holdings.items()}
        self.parts, self.pack, self.leader = parts, pack, leader
        self.sent_bytes = 0  # tensor bytes this rank sent, summed over the engine ranks
        self.rank_bytes = dict.fromkeys(group.receiving_ranks, 0)  # padding included

    def run(self) -> None:
        """Send every bucket, then end the session.

        Raises:
            TimeoutError, GroupBrokenError: an operation did not complete (the group is broken).
            ProtocolError: the leader's messages are not this session's.
        """
        _, begin = self._share(UpdateBegin, PushSession.begin_message)
        # two buckets in flight (pack one, send one): their operations, with the tensors they
        # read (which must live until they complete), by bucket index
        pending: dict[int, list] = {}
        for bucket in self.plan.buckets:
            self._finish(pending, bucket.index - 2)
            announced, ops = self._share(BucketSent, self._announce, bucket)
            if announced.bucket_index != bucket.index:
                index = announced.bucket_index
                raise ProtocolError(f"BucketSent of bucket {index}, expected {bucket.index}")
            sends = self._broadcast(bucket) if self.parts is None else self._send_parts(bucket)
            pending[bucket.index] = ops + sends
        for index in sorted(pending):
            self._finish(pending, index)
        _, end = self._share(UpdateEnd, PushSession.end_message)
        for work, _ in [*begin, *end]:
            wait(self.group, work, self.deadline, "the session's messages")

    def _finish(self, pending: dict[int, list], index: int) -> None:
        """Wait for bucket `index`'s operations, if pending, then advance the push's progress."""
        if index not in pending:
            return
        for work, _ in pending.pop(index):
            wait(self.group, work, self.deadline, f"bucket {index}")
        if self.leader is not None and self.plan.buckets[index].nbytes:
            self.leader.progress(self.plan.buckets[index].nbytes)

    def _share(self, kind: type[Message], message: Callable[..., Message], *args: object) -> tuple:
        """The leader broadcasts `message(session, *args)`; the others receive it (a `kind` of
        this session). Returns the message and the pending operations."""
        if self.leader is None:
            return expect_message(self.group, kind, self.session_id, self.deadline), []
        sent = message(self.leader.session, *args)
        return sent, broadcast_message(self.group, sent, self.deadline)

    def _announce(self, session: PushSession, bucket: BucketPlan) -> BucketSent:
        """The bucket's message: the digests of the tensors it completes, and in parts mode
        which trainer rank sends each engine rank which part."""
        return BucketSent(
            session_id=self.session_id,
            bucket_index=bucket.index,
            digests={
                e.name: session.digests[e.name]
                for e in bucket.entries
                if e.tensor_offset + e.nbytes == e.tensor_nbytes
            },
            parts={} if self.parts is None else self.parts.wire[bucket.index],
        )

    # --- the data ---

    def _broadcast(self, bucket: BucketPlan) -> list:
        """One collective per entry, straight from the tensors: no packing copy on this side,
        and each lands at its place in the receivers' bucket buffers."""
        ops = []
        timeout = op_timeout(self.deadline, f"broadcast of bucket {bucket.index}")
        buffer = self.group.buffer(("send", bucket.index % 2), self.plan.bucket_bytes)
        for entry in bucket.entries:
            if entry.nbytes:
                data = self._entry_bytes(entry, buffer)
                ops.append((self.group.pg.broadcast(data, 0, timeout), data))
        self.sent_bytes += bucket.payload_bytes  # one send, whatever the receivers
        for group_rank in self.rank_bytes:
            self.rank_bytes[group_rank] += bucket.nbytes
        return ops

    def _entry_bytes(self, entry: BucketEntry, buffer: torch.Tensor) -> torch.Tensor:
        """The entry's bytes: a view of the source tensor when it is contiguous (no copy),
        else packed into the bucket buffer."""
        tensor = self.tensors.get(entry.name)
        if tensor is None or not tensor.is_contiguous():
            pack_entries(buffer, [entry], self.tensors)  # also raises for a missing tensor
            return buffer[entry.offset : entry.end]
        check_entry_tensor(entry, tensor)
        start = entry.tensor_offset
        return byte_view(tensor.detach())[start : start + entry.nbytes]

    def _send_parts(self, bucket: BucketPlan) -> list:
        """Post this rank's payload of the bucket to every engine rank it sends parts to."""
        assert self.parts is not None
        ops = []
        mine = self.parts.mine[bucket.index]
        for number, (target, parts) in enumerate(zip(self.parts.targets, mine, strict=True)):
            if not parts:
                continue
            payload, nbytes = self.pack(self, parts, ("send", bucket.index % 2, number))
            for group_rank in target.group_ranks:
                ops.append((self.group.pg.send([payload], group_rank, DATA_TAG), payload))
                self.sent_bytes += nbytes
                self.rank_bytes[group_rank] += payload.numel()
        return ops
