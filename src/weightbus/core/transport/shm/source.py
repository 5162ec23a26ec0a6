"""`shm`, engine-rank side: map the publisher's slots (or offer this rank's parameters for
direct writes), follow its messages and acknowledge each slot once its bucket is loaded."""

import threading
import time
from collections.abc import Iterator

import torch

from weightbus.core.plan import BucketPlan, Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.transport.base import ReceivedBatch
from weightbus.core.transport.parts.arena import DirectPlacement
from weightbus.core.transport.parts.direct_channel import written_batches
from weightbus.core.transport.parts.rank_session import RankSessionSource
from weightbus.core.transport.parts.shared_memory import Slot
from weightbus.core.transport.shm.description import ShmDescription
from weightbus.core.wire import BucketReady, DirectReady, ProtocolError, ReceiverHello, UpdateBegin

# Slots mapped by this process, by name: each rank maps a publisher's slots once and reuses
# the mapping while the same file stands under that name.
_mapped: dict[str, Slot] = {}
_mapped_lock = threading.Lock()
# Tensors larger than a bucket are reassembled into buffers kept across pushes: a fresh
# allocation per push would fault in its pages (~5x slower than copying into warm memory).
_assembly_buffers: dict[tuple, torch.Tensor] = {}


def _map_slots(names: list[str], slot_bytes: int) -> list[Slot]:
    slots = []
    with _mapped_lock:
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


class ShmSource(RankSessionSource):
    """Engine-rank side of `shm` for one session.

    Args:
        direct: this rank's parameters in shared memory, offered for direct writes; the
            publisher decides (`UpdateBegin.direct`).
    """

    def __init__(
        self,
        description: ShmDescription,
        *,
        rank: int = 0,
        tp_size: int = 1,
        direct: DirectPlacement | None = None,
    ) -> None:
        refusal = f"shm endpoint {description.endpoint!r} cannot be connected"
        super().__init__(description, rank=rank, tp_size=tp_size, direct=direct, refusal=refusal)
        self._direct = False
        self._slot_names, self._slot_bytes = description.slots, description.slot_bytes
        self.slots: list[Slot] = []  # mapped at begin, for a session through the slots
        self._plan: Plan | None = None

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
        self._plan = plan_buckets([meta.to_meta() for meta in header.tensors], header.bucket_bytes)
        return header

    def _confirm_direct(self) -> None:
        # sent before begin() returns: the Receiver marks the target touched right after
        ready = DirectReady(session_id=self.session_id, group=self.group, rank=self.rank)
        self._socket.send(ready.encode())

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._plan is not None, "begin() first"
        if self._direct:
            yield from written_batches(self._recv, self._plan, self._placement.regions, timeout_s)
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
                release=self._acker(ready.bucket_index, ready.slot),
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
