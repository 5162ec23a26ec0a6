"""One `dist` session as a trainer rank sends it on the weights group, two buckets in flight.

The leader (group rank 0) broadcasts the session's messages: `UpdateBegin`, a `BucketSent` per
bucket (the digests of the tensors it completes; in parts mode, which trainer rank sends each
engine rank which part), `UpdateEnd`. Every other trainer rank takes part in those broadcasts
(a broadcast is a collective of the whole group), and sends its parts of a bucket once its
`BucketSent` arrived. Data goes out as asynchronous operations, so packing bucket k+1 overlaps
sending bucket k:

- `broadcast` (a group of one): one broadcast per bucket entry, straight from the trainer's
  tensor (no packing copy), into its place in every engine rank's bucket buffer;
- `parts`: each trainer rank packs, per engine rank (ranks of the same slice map share one
  payload), the parts it sends, followed by their xxh3-128, and sends it point to point.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import BucketEntry, byte_view, check_entry_tensor, pack_entries
from weightbus.core.transport.base import Progress, PushSession
from weightbus.core.transport.distributed.group import (
    DATA_TAG,
    WeightsGroup,
    broadcast_message,
    op_timeout,
    receive_broadcast_message,
    wait,
)
from weightbus.core.transport.distributed.schedule import BucketParts, SendPart
from weightbus.core.transport.distributed.slices import SliceTarget
from weightbus.core.wire import Message, ProtocolError, UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import BucketSent, SentPart

# packs this rank's parts for one payload: (parts, buffer key) -> (payload, their tensor bytes)
Pack = Callable[[list[SendPart], tuple], tuple[torch.Tensor, int]]


@dataclass
class LeaderPart:
    """What only the leader's sender does in a session (the sink's hooks): broadcast the
    session's messages and tell the push's progress.

    Attributes:
        key: the session's step on the trainer group (set as it starts: after a failure, the
            sink asks the other ranks' reports there).
    """

    session: PushSession
    progress: Progress
    key: str = ""


@dataclass(frozen=True)
class PartsPlan:
    """A session's parts (the same on every trainer rank) and this rank's own, per bucket and
    target; `wire[bucket]`: what each engine group rank is told it receives from whom."""

    plan: Plan
    targets: list[SliceTarget]
    parts: BucketParts
    mine: BucketParts
    wire: list[dict[int, list[SentPart]]]

    @classmethod
    def of(
        cls, plan: Plan, targets: list[SliceTarget], parts: BucketParts, rank: int
    ) -> "PartsPlan":
        """The plan of `parts` as trainer rank `rank` follows it."""
        mine = [[[p for p in target if p.part.src == rank] for target in b] for b in parts]
        wire = [
            {
                group_rank: [send.part for send in target_parts]
                for target, target_parts in zip(targets, bucket, strict=True)
                for group_rank in target.group_ranks
            }
            for bucket in parts
        ]
        return cls(plan, targets, parts, mine, wire)


@dataclass
class _InFlight:
    """Operations of one bucket not yet known complete (with the tensors they read, which
    must live until then), and the bytes the push advances by once they are."""

    ops: list[tuple[object, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0


class SessionRun:
    """One rank's sends of one session (`leader`: the leader's, which also broadcasts the
    messages).

    Args:
        parts: the parts plan (parts mode), or None (broadcast mode: a group of one).
        pack: packs this rank's parts of a payload (the sender's).
    """

    def __init__(
        self,
        group: WeightsGroup,
        *,
        plan: Plan,
        session_id: str,
        tensors: Mapping[str, torch.Tensor],
        deadline: float,
        parts: PartsPlan | None,
        pack: Pack,
        leader: LeaderPart | None,
    ) -> None:
        self.group, self.plan, self.session_id = group, plan, session_id
        self.tensors, self.deadline = tensors, deadline
        self.parts, self.pack, self.leader = parts, pack, leader
        self.in_flight = [_InFlight(), _InFlight()]  # double buffering: pack one, send one
        self.sent_bytes = 0  # tensor bytes this rank sent, summed over the engine ranks
        self.rank_bytes = dict.fromkeys(group.receiving_ranks, 0)  # padding included

    def run(self) -> None:
        """Send every bucket, then end the session.

        Raises:
            TimeoutError, GroupBrokenError: an operation did not complete (the group is broken).
            ProtocolError: the leader's messages are not this session's.
        """
        begin = self._begin()
        for bucket in self.plan.buckets:
            pending = self.in_flight[bucket.index % 2]
            self._finish(pending, f"bucket {bucket.index - 2}")
            pending.ops += self._announce(bucket)
            if self.parts is None:
                pending.ops += self._broadcast(bucket)
            else:
                pending.ops += self._send_parts(bucket)
            pending.nbytes = bucket.nbytes
        for pending in self.in_flight:
            self._finish(pending, "the last buckets")
        end = self._end()
        for work, _ in [*begin, *end]:
            wait(self.group, work, self.deadline, "the session's messages")

    def _finish(self, pending: _InFlight, what: str) -> None:
        for work, _ in pending.ops:
            wait(self.group, work, self.deadline, what)
        if self.leader is not None and pending.nbytes:
            self.leader.progress(pending.nbytes)
        pending.ops, pending.nbytes = [], 0

    # --- the session's messages: the leader broadcasts, the others take part ---

    def _begin(self) -> list:
        if self.leader is None:
            self._expect(UpdateBegin)
            return []
        return broadcast_message(self.group, self.leader.session.begin_message(), self.deadline)

    def _announce(self, bucket: BucketPlan) -> list:
        if self.leader is None:
            message = self._expect(BucketSent)
            if message.bucket_index != bucket.index:
                index = message.bucket_index
                raise ProtocolError(f"BucketSent of bucket {index}, expected {bucket.index}")
            return []
        message = BucketSent(
            session_id=self.session_id,
            bucket_index=bucket.index,
            digests=completed_digests(self.leader.session, bucket),
            parts={} if self.parts is None else self.parts.wire[bucket.index],
        )
        return broadcast_message(self.group, message, self.deadline)

    def _end(self) -> list:
        if self.leader is None:
            self._expect(UpdateEnd)
            return []
        return broadcast_message(self.group, self.leader.session.end_message(), self.deadline)

    def _expect(self, kind: type[Message]) -> Message:
        message = receive_broadcast_message(self.group, self.deadline, f"a {kind.__name__}")
        if not isinstance(message, kind) or getattr(message, "session_id", None) != self.session_id:
            raise ProtocolError(
                f"expected a {kind.__name__} of session {self.session_id}, got "
                f"a {type(message).__name__}"
            )
        return message

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
            payload, nbytes = self.pack(parts, ("send", bucket.index % 2, number))
            for group_rank in target.group_ranks:
                ops.append((self.group.pg.send([payload], group_rank, DATA_TAG), payload))
                self.sent_bytes += nbytes
                self.rank_bytes[group_rank] += payload.numel()
        return ops


def completed_digests(session: PushSession, bucket: BucketPlan) -> dict[str, str]:
    """The digests of the tensors whose last byte is in `bucket`."""
    return {
        e.name: session.digests[e.name]
        for e in bucket.entries
        if e.tensor_offset + e.nbytes == e.tensor_nbytes
    }
