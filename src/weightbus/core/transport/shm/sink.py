"""`shm`, publisher side: co-located engines read buckets straight from shared-memory slots.

The publisher owns `num_slots` slots (ping-pong) created once and reused by every push, and a
ZMQ ROUTER socket in a private `ipc://` directory. Each engine rank maps the slots once, joins a
session with `ReceiverHello`, and then per bucket only a small `BucketReady` message travels;
the rank copies its TP slices from the slot into its parameters (through `load_weights`, which
narrows the full-tensor views) and answers `SlotAck`. The publisher packs bucket k+1 into the
other slot meanwhile, and writes each bucket once whatever the number of engines and ranks.

Asked to (`stream(refuse_nonfinite=True)`), the copies refuse NaN/inf as they go: the stream
fails naming the tensor and every rank is aborted. The Publisher asks only where the bytes
written so far land in memory the engines discard on an abort (atomic whole-version pushes).
"""

import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import closing

import msgspec
import torch
import zmq

from weightbus.core.plan import BucketPlan
from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.parts.direct_channel import receive_one
from weightbus.core.transport.parts.rank_session import JoiningRanks
from weightbus.core.transport.parts.shared_memory import Slot, private_ipc_dir, remove_stale_slots
from weightbus.core.transport.shm.description import ShmDescription
from weightbus.core.transport.shm.direct import DirectWriter, MappedTarget
from weightbus.core.wire import (
    BucketReady,
    DirectReady,
    DirectTarget,
    Message,
    ReceiverHello,
    SlotAck,
    TensorsWritten,
    UpdateAbort,
    WireEntry,
)

logger = logging.getLogger(__name__)

DEFAULT_NUM_SLOTS = 2


class SessionReceivers(JoiningRanks):
    """The ranks that joined the current session, by ZMQ identity, and their pending acks."""

    def __init__(self, session: PushSession) -> None:
        super().__init__(session)
        self.session_id = session.session_id
        self.num_groups = session.receivers
        self.identities: dict[bytes, tuple[int, int]] = {}  # -> (group, rank)
        self.direct: dict[bytes, DirectTarget | None] = {}  # -> the rank's direct offer
        self.unacked: dict[int, set[tuple[int, int]]] = {}  # slot -> (group, rank) holding it
        self.direct_ready: set[tuple[int, int]] = set()  # (group, rank) that know it is direct

    def joined_groups(self) -> Iterator[int]:
        return (group for group, _ in self.identities.values())

    def holders(self, slot: int) -> str:
        """The ranks still holding `slot`, by engine URL and rank."""
        return ", ".join(
            f"{self.engine_name(group)} rank {rank}"
            for group, rank in sorted(self.unacked.get(slot, ()))
        )

    def on_message(self, identity: bytes, message: Message) -> None:
        if getattr(message, "session_id", None) != self.session_id:
            return  # a late message of an earlier session
        if isinstance(message, ReceiverHello) and message.group < self.num_groups:
            self.identities[identity] = (message.group, message.rank)
            self.direct[identity] = message.direct
            self.tp_sizes[message.group] = message.tp_size
        elif isinstance(message, DirectReady):
            self.direct_ready.add((message.group, message.rank))
        elif isinstance(message, SlotAck):
            # acks come from another socket of the rank than its hello: match by (group, rank)
            self.unacked.get(message.slot, set()).discard((message.group, message.rank))


class ShmSink(BucketSink):
    """Publisher side of `shm`.

    Args:
        num_slots: shared-memory slots (>= 2: one is filled while receivers read another).
        direct: write straight into the ranks' parameters when every rank offers them
            (False: always use the slots).
    """

    name = "shm"
    copies_locally = True  # memcpy speed: `auto` pushes whole versions over it
    # `stream(refuse_nonfinite=True)`: its copies refuse NaN/inf (the Publisher's pre-pass
    # can be skipped where a failed stream serves nothing)
    refuses_nonfinite_in_stream = True

    def __init__(self, num_slots: int = DEFAULT_NUM_SLOTS, direct: bool = True) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2, got {num_slots}")
        remove_stale_slots()
        self.num_slots = num_slots
        # Slots are named at the first prepare (the description carries the names) and created
        # only when a session streams through them: a direct session needs none.
        self.slots: list[Slot] = []
        self._slot_names: list[str] = []
        self._slot_bytes = 0
        self._ipc_dir = private_ipc_dir()
        self.endpoint = f"ipc://{self._ipc_dir / 'sock'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.bind(self.endpoint)
        self.direct = direct
        self._writer = DirectWriter()
        self._targets: dict[str, MappedTarget] = {}  # ranks' parameter files, by name
        self._direct_session = False

    @property
    def mode(self) -> str:
        return "shm direct" if self._direct_session else "shm slots"

    def _name_slots(self, slot_bytes: int) -> None:
        if self._slot_names and self._slot_bytes >= slot_bytes:
            return
        self._free_slots()
        self._slot_names = [Slot.new_name(index) for index in range(self.num_slots)]
        self._slot_bytes = slot_bytes

    def _create_slots(self) -> None:
        if self.slots:
            return
        try:
            for name in self._slot_names:
                self.slots.append(Slot.create(name, self._slot_bytes))
        except OSError as exc:
            for slot in self.slots:
                slot.unlink()
            self.slots = []
            raise OSError(
                f"cannot create {self.num_slots} slots of {self._slot_bytes} bytes: {exc}"
            ) from exc
        logger.info("created %d shared-memory slots of %d bytes", self.num_slots, self._slot_bytes)

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> ShmDescription:
        self._name_slots(session.plan.bucket_bytes)
        if not self.direct:
            self._create_slots()  # every session streams through them
        return ShmDescription(
            endpoint=self.endpoint,
            session_id=session.session_id,
            slots=list(self._slot_names),
            slot_bytes=self._slot_bytes,
        )

    def for_engine(self, description: ShmDescription, engine_index: int) -> ShmDescription:
        # each engine's ranks say which engine they belong to: the sink waits for all of them
        return msgspec.structs.replace(description, group=engine_index)

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
        *,
        refuse_nonfinite: bool = False,
    ) -> None:
        """As `BucketSink.stream`; with `refuse_nonfinite`, the copies check every floating
        chunk they copy.

        Raises:
            NonFiniteWeightsError: `refuse_nonfinite` and a tensor holds NaN or inf (named);
                the ranks were told to abort.
        """
        deadline = time.monotonic() + timeout_s
        receivers = SessionReceivers(session)
        try:
            # the ranks that joined hear of a failure at once, not at their own timeout
            receivers.wait_until_complete(
                lambda what, anyway: self._receive(receivers, deadline, what, anyway)
            )
            targets = self._direct_targets(receivers, session)
            self._direct_session = targets is not None
            if targets is None:
                self._create_slots()  # before the ranks map them, at their begin
                self._send_all(receivers, session.begin_message())
                self._stream_slots(
                    session,
                    tensors,
                    receivers,
                    deadline,
                    progress,
                    refuse_nonfinite=refuse_nonfinite,
                )
            else:
                begin = msgspec.structs.replace(session.begin_message(), direct=True)
                self._send_all(receivers, begin)
                self._stream_direct(
                    session,
                    tensors,
                    receivers,
                    targets,
                    deadline=deadline,
                    progress=progress,
                    refuse_nonfinite=refuse_nonfinite,
                )
        except Exception as exc:
            # receivers learn at once instead of waiting out their timeout
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            self._send_all(receivers, UpdateAbort(session_id=session.session_id, reason=reason))
            raise
        self._send_all(receivers, session.end_message())

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
        hashers: dict = {}  # digests of tensors split across buckets, in progress
        for bucket in session.plan.buckets:
            slot = bucket.index % self.num_slots
            while receivers.unacked.get(slot):
                holders = receivers.holders(slot)
                self._receive(receivers, deadline, f"{holders} to release slot {slot}")
            digests = self._writer.pack(
                self.slots[slot].tensor,
                bucket,
                tensors,
                hashers,
                refuse_nonfinite=refuse_nonfinite,
            )
            session.digests.update(digests)
            receivers.unacked[slot] = set(receivers.identities.values())
            self._send_all(receivers, bucket_message(session, bucket, slot, digests))
            session.count_sent(bucket.payload_bytes)  # once, whatever the number of ranks
            progress(bucket.payload_bytes)
        while any(receivers.unacked.values()):
            holders = ", ".join(receivers.holders(slot) for slot in receivers.unacked)
            self._receive(receivers, deadline, f"{holders} to release the last slots")

    def _direct_targets(
        self, receivers: SessionReceivers, session: PushSession
    ) -> list[MappedTarget] | None:
        """Every rank's mapped parameter file, in `receivers.identities` order; None for
        slot mode (direct mode off, a rank offered nothing, or an offer is unusable)."""
        offers = [receivers.direct[identity] for identity in receivers.identities]
        if not self.direct or any(offer is None for offer in offers):
            return None
        planned = {meta.name for meta in session.plan.metas}
        if any({copy.hf_name for copy in offer.copies} != planned for offer in offers):
            return None  # not the parameters' tensors (a delta's payload): the slots carry it
        try:
            targets = [self._mapped_target(offer, session) for offer in offers]
        except ValueError as exc:
            logger.warning("direct mode refused, streaming through slots: %s", exc)
            return None
        finally:
            # keep files not offered now but still there: an atomic engine alternates between
            # two arenas (live and staging swap on every commit), and re-mapping one costs a
            # page fault per page on the next push
            offered = {offer.file for offer in offers}
            for name in [n for n, t in self._targets.items() if n not in offered]:
                if not self._targets[name].is_current():  # the engine went away or re-allocated
                    self._targets.pop(name).close()
        return targets

    def _mapped_target(self, offer: DirectTarget, session: PushSession) -> MappedTarget:
        target = self._targets.get(offer.file)
        key = (offer.file, offer.layout_hash, session.plan.plan_hash)
        if target is None or target.key != key or not target.is_current():
            if target is not None:
                target.close()
            target = self._targets[offer.file] = MappedTarget(offer, session.plan)
        return target

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
        identities = list(receivers.identities)
        self._await_direct_ready(receivers, deadline)
        nbytes = {bucket.index: bucket.payload_bytes for bucket in session.plan.buckets}
        writes = self._writer.write(
            session.plan,
            tensors,
            targets,
            deadline,
            slice_digests=session.verify,
            refuse_nonfinite=refuse_nonfinite,
        )
        # closed however the loop ends: no copy writes any more once the ranks hear of it
        with closing(writes):
            for bucket_index, written in writes:
                digests = {name: digest for name, (digest, _) in written.items()}
                session.digests.update(digests)
                session.count_sent(
                    sum(target.slice_bytes.get(name, 0) for target in targets for name in written)
                )
                for rank_index, identity in enumerate(identities):
                    message = TensorsWritten(
                        session_id=session.session_id,
                        bucket_index=bucket_index,
                        digests=digests,
                        slice_digests={
                            name: slices[rank_index]
                            for name, (_, slices) in written.items()
                            if rank_index in slices
                        },
                    )
                    self._socket.send_multipart([identity, message.encode()])
                progress(nbytes[bucket_index])

    def _await_direct_ready(self, receivers: SessionReceivers, deadline: float) -> None:
        """No byte lands in a rank's parameters before the rank knows they are being written:
        wait until every rank confirmed direct mode."""
        while not set(receivers.identities.values()) <= receivers.direct_ready:
            self._receive(receivers, deadline, "every rank to confirm direct mode")

    def _receive(
        self, receivers: SessionReceivers, deadline: float, what: str, anyway: bool = False
    ) -> None:
        receive_one(
            self._socket,
            receivers.session,
            receivers.on_message,
            deadline,
            what,
            even_if_abandoned=anyway,
        )

    def _send_all(self, receivers: SessionReceivers, message: Message) -> None:
        frame = message.encode()
        for identity in receivers.identities:
            self._socket.send_multipart([identity, frame])

    def _free_slots(self) -> None:
        for slot in self.slots:
            slot.unlink()
            slot.close()
        self.slots = []
        self._slot_names = []

    def close(self) -> None:
        self._free_slots()
        self._writer.close()
        for target in self._targets.values():
            target.close()
        self._targets.clear()
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def bucket_message(
    session: PushSession, bucket: BucketPlan, slot: int, digests: dict[str, str]
) -> BucketReady:
    """`digests`: of the tensors whose last byte is in this bucket."""
    return BucketReady(
        session_id=session.session_id,
        bucket_index=bucket.index,
        slot=slot,
        entries=[WireEntry.of(entry) for entry in bucket.entries],
        digests=digests,
    )
