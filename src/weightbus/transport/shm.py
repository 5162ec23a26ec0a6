"""`shm`: co-located engines read buckets straight from shared-memory slots.

The publisher owns `num_slots` slots (ping-pong) created once and reused by every push, and a
ZMQ ROUTER socket in a private `ipc://` directory. Each engine rank maps the slots once, joins a
session with `ReceiverHello`, and then per bucket only a small `BucketReady` message travels;
the rank copies its TP slices from the slot into its parameters (through `load_weights`, which
narrows the full-tensor views) and answers `SlotAck`. The publisher packs bucket k+1 into the
other slot meanwhile, and writes each bucket once whatever the number of engines and ranks.
"""

import logging
import shutil
import threading
import time
from collections.abc import Iterator, Mapping

import msgspec
import torch
import zmq

from weightbus.plan import BucketPlan, Plan, plan_buckets
from weightbus.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.transport.base import (
    BucketSink,
    BucketSource,
    Progress,
    PushSession,
    ReceivedBatch,
    no_progress,
)
from weightbus.transport.shm_arena import DirectPlacement
from weightbus.transport.shm_direct import DirectWriter, MappedTarget
from weightbus.transport.shm_slots import SLOT_PREFIX, Slot, private_ipc_dir, remove_stale_slots
from weightbus.wire import (
    BucketReady,
    DirectReady,
    DirectTarget,
    Message,
    ProtocolError,
    ReceiverHello,
    SlotAck,
    TensorsWritten,
    UpdateAbort,
    UpdateBegin,
    UpdateEnd,
    WireEntry,
    decode,
)

logger = logging.getLogger(__name__)

DEFAULT_NUM_SLOTS = 2
# How often a wait on the receivers checks whether the push was abandoned.
ABANDON_CHECK_MS = 100


def _remaining_ms(deadline: float, what: str) -> int:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out waiting for {what}")
    return max(1, int(remaining * 1000))


class _Receivers:
    """The ranks that joined the current session, by ZMQ identity, and their pending acks."""

    def __init__(self, session: PushSession) -> None:
        self.session = session
        self.session_id = session.session_id
        self.num_groups = session.receivers
        self.identities: dict[bytes, tuple[int, int]] = {}  # -> (group, rank)
        self.direct: dict[bytes, DirectTarget | None] = {}  # -> the rank's direct offer
        self.tp_sizes: dict[int, int] = {}
        self.unacked: dict[int, set[tuple[int, int]]] = {}  # slot -> (group, rank) holding it
        self.direct_ready: set[tuple[int, int]] = set()  # (group, rank) that know it is direct

    def complete(self) -> bool:
        joined = dict.fromkeys(self.tp_sizes, 0)
        for group, _ in self.identities.values():
            joined[group] += 1
        return len(self.tp_sizes) == self.num_groups and all(
            joined[group] == size for group, size in self.tp_sizes.items()
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
    ) -> dict:
        self._name_slots(session.plan.bucket_bytes)
        if not self.direct:
            self._create_slots()  # every session streams through them
        return {
            "endpoint": self.endpoint,
            "session_id": session.session_id,
            "slots": list(self._slot_names),
            "slot_bytes": self._slot_bytes,
        }

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        receivers = _Receivers(session)
        while not receivers.complete():
            self._receive(receivers, deadline, "every engine rank to join")
        targets = self._direct_targets(receivers, session)
        self._direct_session = targets is not None
        try:
            if targets is None:
                self._create_slots()  # before the ranks map them, at their begin
                self._send_all(receivers, session.begin_message())
                self._stream_slots(session, tensors, receivers, deadline, progress)
            else:
                begin = msgspec.structs.replace(session.begin_message(), direct=True)
                self._send_all(receivers, begin)
                self._stream_direct(
                    session, tensors, receivers, targets, deadline=deadline, progress=progress
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
        receivers: _Receivers,
        deadline: float,
        progress: Progress,
    ) -> None:
        hashers: dict = {}  # digests of tensors split across buckets, in progress
        for bucket in session.plan.buckets:
            slot = bucket.index % self.num_slots
            while receivers.unacked.get(slot):
                self._receive(receivers, deadline, f"receivers to release slot {slot}")
            digests = self._writer.pack(self.slots[slot].tensor, bucket, tensors, hashers)
            session.digests.update(digests)
            receivers.unacked[slot] = set(receivers.identities.values())
            self._send_all(receivers, _bucket_message(session, bucket, slot, digests))
            progress(bucket.payload_bytes)
        while any(receivers.unacked.values()):
            self._receive(receivers, deadline, "receivers to release the last slots")

    def _direct_targets(
        self, receivers: _Receivers, session: PushSession
    ) -> list[MappedTarget] | None:
        """Every rank's mapped parameter file, in `receivers.identities` order; None for
        slot mode (direct mode off, a rank offered nothing, or an offer is unusable)."""
        offers = [receivers.direct[identity] for identity in receivers.identities]
        if not self.direct or any(offer is None for offer in offers):
            return None
        try:
            targets = [self._mapped_target(offer, session) for offer in offers]
        except ValueError as exc:
            logger.warning("direct mode refused, streaming through slots: %s", exc)
            return None
        finally:
            for name in set(self._targets) - {offer.file for offer in offers}:
                self._targets.pop(name).close()  # an engine went away or re-allocated
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
        receivers: _Receivers,
        targets: list[MappedTarget],
        *,
        deadline: float,
        progress: Progress,
    ) -> None:
        identities = list(receivers.identities)
        # no byte lands in a rank's parameters before the rank knows they are being written
        while not set(receivers.identities.values()) <= receivers.direct_ready:
            self._receive(receivers, deadline, "every rank to confirm direct mode")
        nbytes = {bucket.index: bucket.payload_bytes for bucket in session.plan.buckets}
        writes = self._writer.write(
            session.plan, tensors, targets, deadline, slice_digests=session.verify
        )
        for bucket_index, written in writes:
            digests = {name: digest for name, (digest, _) in written.items()}
            session.digests.update(digests)
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

    def _receive(self, receivers: _Receivers, deadline: float, what: str) -> None:
        if receivers.session.abandoned is not None:
            raise ValueError(f"stopped waiting for {what}: {receivers.session.abandoned}")
        if not self._socket.poll(min(_remaining_ms(deadline, what), ABANDON_CHECK_MS)):
            return
        identity, data = self._socket.recv_multipart()
        try:
            receivers.on_message(identity, decode(data))
        except ProtocolError as exc:
            logger.warning("dropping a malformed message from a receiver: %s", exc)

    def _send_all(self, receivers: _Receivers, message: Message) -> None:
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


def _bucket_message(
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


# Slots mapped by this process, by name: each rank maps a publisher's slots once and reuses
# the mapping while the same file stands under that name.
_mapped: dict[str, Slot] = {}
_mapped_lock = threading.Lock()
# Tensors larger than a bucket are reassembled into buffers kept across pushes: a fresh
# allocation per push would fault in its pages (~5x slower than copying into warm memory).
_assembly_buffers: dict[tuple, torch.Tensor] = {}


def _map_slots(names: list[str], slot_bytes: int) -> list[Slot]:
    with _mapped_lock:
        return _map_slots_locked(names, slot_bytes)


def _map_slots_locked(names: list[str], slot_bytes: int) -> list[Slot]:
    slots = []
    for name in names:
        slot = _mapped.get(name)
        if slot is not None and slot.current_identity() != slot.identity:
            raise ValueError(f"stale mapping: shared-memory slot {name} was replaced")
        if slot is None or slot.nbytes < slot_bytes:
            slot = _mapped[name] = Slot.open(name, slot_bytes)
        slots.append(slot)
    for name in set(_mapped) - set(names):  # a new publisher session: forget the old slots
        _mapped.pop(name).close()
    return slots


def _description_fields(description: dict) -> tuple[str, str, list[str], int, int]:
    try:
        endpoint = description["endpoint"]
        session_id = description["session_id"]
        names = description["slots"]
        slot_bytes = description["slot_bytes"]
        group = description.get("group", 0)
    except (KeyError, TypeError):
        raise ValueError(
            "shm source needs {'endpoint', 'session_id', 'slots', 'slot_bytes', 'group'}"
        ) from None
    if not (isinstance(endpoint, str) and endpoint.startswith("ipc://")):
        raise ValueError(f"shm endpoint must be an ipc:// address, got {endpoint!r}")
    if not (isinstance(names, list) and len(names) >= 2 and all(isinstance(n, str) for n in names)):
        raise ValueError("shm source needs a list of at least two slot names")
    for name in names:
        if not name.startswith(SLOT_PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not a weightbus shared-memory file")
    if not (isinstance(slot_bytes, int) and slot_bytes > 0 and isinstance(group, int)):
        raise ValueError("shm slot_bytes must be a positive integer and group an integer")
    return endpoint, str(session_id), names, slot_bytes, group


class ShmSource(BucketSource):
    """Engine-rank side of `shm` for one session.

    Args:
        direct: this rank's parameters in shared memory, offered for direct writes; the
            publisher decides (`UpdateBegin.direct`).
    """

    def __init__(
        self,
        description: dict,
        *,
        rank: int = 0,
        tp_size: int = 1,
        direct: DirectPlacement | None = None,
    ) -> None:
        endpoint, self.session_id, names, slot_bytes, self.group = _description_fields(description)
        self.rank = rank
        self.tp_size = tp_size
        self._placement = direct
        self._direct = False
        self._slot_names, self._slot_bytes = names, slot_bytes
        self.slots: list[Slot] = []  # mapped at begin, for a session through the slots
        self._context = zmq.Context.instance()
        self._endpoint = endpoint
        # Messages are read by the Receiver's prefetch thread, acks are sent by the thread that
        # loads: ZMQ sockets are single-threaded, so each direction has its own socket.
        self._socket = self._context.socket(zmq.DEALER)
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:  # e.g. a path too long for a unix socket
            self._socket.close(linger=0)
            raise ValueError(f"shm endpoint {endpoint!r} cannot be connected: {exc}") from None
        self._ack_socket: zmq.Socket | None = None
        self._plan: Plan | None = None

    def _recv(self, expected: type[Message], timeout_s: float) -> Message:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._socket.poll(_remaining_ms(deadline, f"a {expected.__name__}")):
                continue
            message = decode(self._socket.recv())
            if getattr(message, "session_id", None) != self.session_id:
                continue  # a message of an earlier session: never read its slots
            if isinstance(message, UpdateAbort):
                raise ValueError(f"the publisher aborted the session: {message.reason}")  # noqa: TRY004 - a peer stopped, not a wrong type
            if not isinstance(message, expected):
                # a peer breaking the protocol, not a caller passing a wrong type
                raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
            return message

    def begin(self, timeout_s: float) -> UpdateBegin:
        hello = ReceiverHello(
            session_id=self.session_id,
            group=self.group,
            rank=self.rank,
            tp_size=self.tp_size,
            direct=None if self._placement is None else self._placement.target,
        )
        self._socket.send(hello.encode())
        header = self._recv(UpdateBegin, timeout_s)
        if header.direct and self._placement is None:
            raise ProtocolError("the publisher chose direct mode, which this rank did not offer")
        self._direct = header.direct
        if header.direct:
            self._confirm_direct()
        else:
            self.slots = _map_slots(self._slot_names, self._slot_bytes)
        metas = [meta.to_meta() for meta in header.tensors]
        self._plan = plan_buckets(metas, header.bucket_bytes)
        return header

    def _confirm_direct(self) -> None:
        # sent before begin() returns: the Receiver marks the target touched right after
        ready = DirectReady(session_id=self.session_id, group=self.group, rank=self.rank)
        self._socket.send(ready.encode())

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._plan is not None, "begin() first"
        if self._direct:
            yield from self._written(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        assembler = ChunkAssembler(buffers=_assembly_buffers)
        for bucket in self._plan.buckets:
            ready = self._recv(BucketReady, deadline - time.monotonic())
            slot = self._check(ready, bucket)
            tensors = list(unpack_bucket(bucket, self.slots[slot].tensor, assembler))
            yield ReceivedBatch(
                tensors=tensors,
                digests=dict(ready.digests),
                nbytes=bucket.payload_bytes,
                release=self._acker(ready),
            )

    def _written(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        """Direct mode: the publisher's notices of what it wrote into this rank's parameters."""
        assert self._plan is not None
        assert self._placement is not None
        deadline = time.monotonic() + timeout_s
        regions = self._placement.regions
        for bucket in self._plan.buckets:
            written = self._recv(TensorsWritten, deadline - time.monotonic())
            names = bucket.finished_names()
            if written.bucket_index != bucket.index or set(written.digests) != set(names):
                raise ValueError(f"written tensors of bucket {bucket.index} do not match the plan")
            yield ReceivedBatch(
                tensors=[],
                digests=dict(written.digests),
                nbytes=bucket.payload_bytes,
                placed=[(name, regions.get(name)) for name in names],
                placed_digests=dict(written.slice_digests),
            )

    def _check(self, ready: BucketReady, bucket: BucketPlan) -> int:
        if ready.bucket_index != bucket.index:
            raise ValueError(f"bucket {ready.bucket_index} arrived, expected {bucket.index}")
        if ready.slot >= len(self.slots):
            raise ValueError(f"bucket {bucket.index} names slot {ready.slot} of {len(self.slots)}")
        if [e.to_entry() for e in ready.entries] != list(bucket.entries):
            raise ValueError(f"bucket {bucket.index} does not match the plan of the session")
        if bucket.nbytes > self.slots[ready.slot].nbytes:
            raise ValueError(f"bucket {bucket.index} exceeds its slot")
        return ready.slot

    def _acker(self, ready: BucketReady):
        ack = SlotAck(
            session_id=self.session_id,
            bucket_index=ready.bucket_index,
            slot=ready.slot,
            rank=self.rank,
            group=self.group,
        ).encode()
        return lambda: self._send_ack(ack)

    def _send_ack(self, frame: bytes) -> None:
        if self._ack_socket is None:
            self._ack_socket = self._context.socket(zmq.DEALER)
            self._ack_socket.connect(self._endpoint)
        self._ack_socket.send(frame)

    def end(self, timeout_s: float) -> UpdateEnd:
        return self._recv(UpdateEnd, timeout_s)

    def close(self) -> None:
        self._socket.close(linger=1000)
        if self._ack_socket is not None:
            self._ack_socket.close(linger=1000)
