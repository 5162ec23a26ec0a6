"""`shm`, publisher side: co-located engines read buckets straight from shared-memory slots.

The publisher owns `num_slots` slots (ping-pong) created once and reused by every push, and a
ZMQ ROUTER socket in a private `ipc://` directory. Each engine rank maps the slots once, joins a
session with `ReceiverHello`, and then per bucket only a small `BucketReady` message travels;
the rank copies its TP slices from the slot into its parameters (through `load_weights`, which
narrows the full-tensor views) and answers `SlotAck`. The publisher packs bucket k+1 into the
other slot meanwhile, and writes each bucket once whatever the number of engines and ranks.

The bytes are written by every trainer rank (`shm/sender.py`; in a group of one, the leader's).

Asked to (`Sending.refuse_nonfinite`), the copies refuse NaN/inf as they go: the stream fails
naming the tensor and every rank is aborted. The Publisher asks only where the bytes written so
far land in memory the engines discard on an abort (atomic whole-version pushes).
"""

import logging
import shutil
import time
from collections.abc import Iterator

import msgspec
import zmq

from weightbus.core.fixes import with_fix
from weightbus.core.trainer.digests import combine, digest_plan
from weightbus.core.trainer.writes import write_outcome
from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.parts.direct_channel import receive_one, tell_outcome, tell_written
from weightbus.core.transport.parts.layout import checked_copies
from weightbus.core.transport.parts.rank_session import JoiningRanks
from weightbus.core.transport.parts.shared_memory import (
    SHM_DIR,
    Slot,
    private_ipc_dir,
    remove_stale_slots,
)
from weightbus.core.transport.sending import Sending
from weightbus.core.transport.shm.description import ShmDescription
from weightbus.core.transport.shm.sender import PackOrder, SlotsOrder, WriteOrder
from weightbus.core.wire import (
    BucketReady,
    DirectReady,
    DirectTarget,
    Message,
    ReceiverHello,
    SlotAck,
    UpdateAbort,
    WireEntry,
)

logger = logging.getLogger(__name__)

DEFAULT_NUM_SLOTS = 2
_CHECKED_KEPT = 16  # offers whose layout is known good (engines alternate between arenas)


class SessionReceivers(JoiningRanks):
    """The ranks that joined the current session, by ZMQ identity, and their pending acks."""

    def __init__(self, session: PushSession) -> None:
        super().__init__(session)
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
        if getattr(message, "session_id", None) != self.session.session_id:
            return  # a late message of an earlier session
        if isinstance(message, ReceiverHello) and message.group < self.session.receivers:
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
    # its copies refuse NaN/inf (the Publisher's pre-pass can be skipped where a failed stream
    # serves nothing)
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
        self._checked: set[tuple] = set()  # offers whose layout was checked, with the plan
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
            size = shutil.disk_usage(SHM_DIR).total
            fix = (
                f"give /dev/shm at least {self.num_slots * self._slot_bytes} bytes (docker: "
                "--shm-size; or mount -o remount,size=... /dev/shm), or push with a smaller "
                "bucket_bytes"
            )
            raise OSError(
                with_fix(
                    f"cannot create {self.num_slots} slots of {self._slot_bytes} bytes in "
                    f"{SHM_DIR} ({size} bytes in all): {exc}",
                    fix,
                )
            ) from exc
        logger.info("created %d shared-memory slots of %d bytes", self.num_slots, self._slot_bytes)

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
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
        sending: Sending,
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """As `BucketSink.stream` (`sending.refuse_nonfinite`: the module docstring)."""
        deadline = time.monotonic() + timeout_s
        receivers = SessionReceivers(session)
        try:
            # the ranks that joined hear of a failure at once, not at their own timeout
            receivers.wait_until_complete(
                lambda what, anyway: self._receive(receivers, deadline, what, anyway)
            )
            offers = self._direct_offers(receivers, session)
            self._direct_session = offers is not None
            if offers is None:
                self._create_slots()  # before the ranks map them, at their begin
                self._send_all(receivers, session.begin_message())
                self._stream_slots(session, sending, receivers, deadline, progress)
            else:
                begin = msgspec.structs.replace(session.begin_message(), direct=True)
                self._send_all(receivers, begin)
                # no byte lands in a rank's parameters before the rank knows they are written
                while not set(receivers.identities.values()) <= receivers.direct_ready:
                    self._receive(receivers, deadline, "every rank to confirm direct mode")
                self._stream_direct(session, sending, receivers, offers, progress)
        except Exception as exc:
            # receivers learn at once instead of waiting out their timeout
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            self._send_all(receivers, UpdateAbort(session_id=session.session_id, reason=reason))
            raise
        self._send_all(receivers, session.end_message())

    def _stream_slots(
        self,
        session: PushSession,
        sending: Sending,
        receivers: SessionReceivers,
        deadline: float,
        progress: Progress,
    ) -> None:
        plan = session.plan
        order = SlotsOrder(
            slots=list(self._slot_names),
            slot_bytes=self._slot_bytes,
            bucket_bytes=plan.bucket_bytes,
            plan_hash=plan.plan_hash,
        )
        blocks = [report.blocks for report in self.everyone(sending, order)]
        split = digest_plan(sending.layout)
        if split.regions:  # the tensors sent in cells, digested in blocks first
            names = [region.name for region in split.regions]
            session.digests.update(zip(names, combine(split, blocks), strict=True))
        rank_sent = [0] * sending.group.world_size
        for bucket in plan.buckets:
            slot = bucket.index % self.num_slots
            while receivers.unacked.get(slot):
                holders = receivers.holders(slot)
                self._receive(receivers, deadline, f"{holders} to release slot {slot}")
            reports = self.everyone(sending, PackOrder(bucket=bucket.index, slot=slot))
            for rank, report in enumerate(reports):
                session.digests.update(report.digests)
                rank_sent[rank] += report.sent_bytes
            receivers.unacked[slot] = set(receivers.identities.values())
            ready = BucketReady(
                session_id=session.session_id,
                bucket_index=bucket.index,
                slot=slot,
                entries=[WireEntry.of(entry) for entry in bucket.entries],
                # of the tensors whose last byte is in this bucket
                digests={name: session.digests[name] for name in bucket.finished_names()},
            )
            self._send_all(receivers, ready)
            session.count_sent(bucket.payload_bytes)  # once, whatever the number of ranks
            progress(bucket.payload_bytes)
        sending.count_sent(rank_sent)
        while any(receivers.unacked.values()):
            holders = ", ".join(receivers.holders(slot) for slot in receivers.unacked)
            self._receive(receivers, deadline, f"{holders} to release the last slots")

    def _direct_offers(
        self, receivers: SessionReceivers, session: PushSession
    ) -> list[DirectTarget] | None:
        """Every rank's offer, in `receivers.identities` order, its layout checked against the
        plan; None for slot mode (direct mode off, a rank offered nothing, or an offer is
        unusable)."""
        offers = [receivers.direct[identity] for identity in receivers.identities]
        if not self.direct or any(offer is None for offer in offers):
            return None
        metas = {meta.name: meta for meta in session.plan.metas}
        if any(offer.named() != metas.keys() for offer in offers):
            return None  # not the parameters' tensors (a delta's payload): the slots carry it
        for offer in offers:
            key = (offer.file, offer.layout_hash, session.plan.plan_hash)
            if key in self._checked:
                continue
            try:
                checked_copies(offer, metas)
            except ValueError as exc:
                logger.warning("direct mode refused, streaming through slots: %s", exc)
                return None
            if len(self._checked) >= _CHECKED_KEPT:
                self._checked.clear()
            self._checked.add(key)
        return offers

    def _stream_direct(
        self,
        session: PushSession,
        sending: Sending,
        receivers: SessionReceivers,
        offers: list[DirectTarget],
        progress: Progress,
    ) -> None:
        identities = list(receivers.identities)

        def tell(bucket_index: int, digests: dict, slices: dict[int, dict[str, str]]) -> None:
            session.digests.update(digests)
            for rank_index, identity in enumerate(identities):
                found = slices.get(rank_index, {})
                tell_written(self._socket, session, identity, bucket_index, digests, slices=found)
            progress(session.plan.buckets[bucket_index].payload_bytes)

        order = WriteOrder(
            targets=offers,
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
            verify=session.verify,
        )
        # a group of one tells each bucket as soon as it is written (the ranks verify it
        # meanwhile); in a group of N, a bucket is written once every rank reported
        reports = self.everyone(sending, order, hooks=tell if sending.single else None)
        sending.count_sent([report.sent_bytes for report in reports])
        session.count_sent(sum(report.sent_bytes for report in reports))
        if sending.single:
            return
        cells = sending.senders(self.key, self.name).cells(sending.layout, order)
        outcome = write_outcome(sending.layout, cells, reports, len(offers))
        session.digests.update(outcome.digests)
        tell_outcome(self._socket, session, identities, outcome, progress)

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
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
