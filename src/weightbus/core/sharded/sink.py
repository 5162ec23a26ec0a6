"""Rank 0's sink of a sharded push over `shm`: the session as `ShmSink` runs it (hellos, direct
offers, `TensorsWritten`, end), with the bytes written by every trainer rank (`GroupWriter`)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import zmq

from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.slots import GroupSlots, SlotsOrder
from weightbus.core.sharded.steps import PackStep, SlotsStep, Step, WriteStep
from weightbus.core.sharded.write import GroupWriter, WriteOrder, WriteOutcome
from weightbus.core.transport.base import Progress, PushSession
from weightbus.core.transport.shm.direct import MappedTarget
from weightbus.core.transport.shm.sink import SessionReceivers, ShmSink, bucket_message
from weightbus.core.wire import TensorsWritten


@dataclass
class SharedPush:
    """What rank 0's sink needs of the push in progress (set before each push)."""

    key: str
    layout: TrainerLayout
    holdings: dict[str, Holding]
    announce: Callable[[Step], None]
    deadline: float  # `time.monotonic()` by which the push must be written
    sent_bytes: list[int] = field(default_factory=list)


def tell_written(
    session: PushSession,
    push: SharedPush,
    outcome: WriteOutcome,
    identities: list[bytes],
    *,
    socket: zmq.Socket,
    progress: Progress,
) -> None:
    """Record what every trainer rank wrote (digests, bytes), then tell each engine rank, per
    bucket, which tensors are written and the digests of its slices (`TensorsWritten`)."""
    session.digests.update(outcome.digests)
    session.count_sent(sum(outcome.sent_bytes))
    push.sent_bytes = outcome.sent_bytes
    for bucket in session.plan.buckets:
        names = bucket.finished_names()
        digests = {name: outcome.digests[name] for name in names}
        for index, identity in enumerate(identities):
            slices = outcome.slice_digests[index]
            message = TensorsWritten(
                session_id=session.session_id,
                bucket_index=bucket.index,
                digests=digests,
                slice_digests={name: slices[name] for name in names if name in slices},
            )
            socket.send_multipart([identity, message.encode()])
        progress(bucket.payload_bytes)


class ShardedShmSink(ShmSink):
    """`shm` for a trainer group's rank 0: every rank copies its own pieces, straight into the
    engine ranks' parameters (direct mode) or into the slots."""

    refuses_nonfinite_in_stream = False  # every rank checked its own shards before the push

    def __init__(self, writer: GroupWriter, slots: GroupSlots, *, direct: bool = True) -> None:
        super().__init__(direct=direct)
        self.group_writer = writer
        self.group_slots = slots
        self.push: SharedPush | None = None

    def _stream_slots(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        receivers: SessionReceivers,
        deadline: float,
        progress: Progress,
        *,
        refuse_nonfinite: bool,
    ) -> None:
        push = self.push
        assert push is not None, "a sharded sink streams only inside a ShardedPublisher push"
        order = SlotsOrder(
            slots=list(self._slot_names),
            slot_bytes=self._slot_bytes,
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
        )
        push.announce(SlotsStep(order=order))
        self.group_slots.begin(push.key, order, push.layout, push.holdings, deadline)
        digests = self.group_slots.digests(push.key, deadline)
        session.digests.update(digests)
        sent = [0] * len(push.layout.by_rank)
        for bucket in session.plan.buckets:
            slot = bucket.index % self.num_slots
            while receivers.unacked.get(slot):
                holders = receivers.holders(slot)
                self._receive(receivers, deadline, f"{holders} to release slot {slot}")
            push.announce(PackStep(bucket=bucket.index, slot=slot))
            self.group_slots.pack(push.key, bucket.index, slot, push.holdings, deadline)
            for rank, nbytes in enumerate(
                self.group_slots.packed(push.key, bucket.index, deadline)
            ):
                sent[rank] += nbytes
            receivers.unacked[slot] = set(receivers.identities.values())
            finished = {name: digests[name] for name in bucket.finished_names()}
            self._send_all(receivers, bucket_message(session, bucket, slot, finished))
            session.count_sent(bucket.payload_bytes)
            progress(bucket.payload_bytes)
        while any(receivers.unacked.values()):
            holders = ", ".join(receivers.holders(slot) for slot in receivers.unacked)
            self._receive(receivers, deadline, f"{holders} to release the last slots")
        push.sent_bytes = sent

    def _stream_direct(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        receivers: SessionReceivers,
        targets: list[MappedTarget],
        *,
        deadline: float,
        progress: Progress,
        refuse_nonfinite: bool,
    ) -> None:
        push = self.push
        assert push is not None, "a sharded sink streams only inside a ShardedPublisher push"
        identities = list(receivers.identities)
        self._await_direct_ready(receivers, deadline)
        order = WriteOrder(
            targets=[receivers.direct[identity] for identity in identities],
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
            verify=session.verify,
        )
        push.announce(WriteStep(order=order))
        self.group_writer.write(push.key, order, push.layout, push.holdings, deadline)
        outcome = self.group_writer.outcome(push.key, push.layout, order, deadline)
        tell_written(session, push, outcome, identities, socket=self._socket, progress=progress)
