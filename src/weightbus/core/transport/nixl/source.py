"""`nixl`, engine-rank side: offer this rank's registered parameters, then follow the
publisher's notices of what it wrote there. The rank's CPU is not on the data path: the bytes
arrive as one-sided NIXL WRITEs, and the rank only re-reads its own regions to verify them.

Tensors of the session that the rank's slice map does not name (a delta push's payload) are
written whole into the rank's *inbox*: `INBOX_SLOTS` slots in one buffer registered with the
rank's agent, made when a session first needs one (sized to its largest bucket of such
tensors), grown when a later session needs more, and reused otherwise. The rank offers it
with a `NixlInbox` after the `UpdateBegin`, hands the Receiver typed views into the slot (a
tensor split across buckets is reassembled), and acknowledges each slot with a `SlotAck` once
the Receiver released its batch.
"""

import threading
import time
from collections.abc import Iterator

import torch

from weightbus.core.plan import BucketPlan, Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.plan.bucket import BucketEntry
from weightbus.core.transport.base import ReceivedBatch
from weightbus.core.transport.nixl.agent import Agent, rank_agent
from weightbus.core.transport.nixl.messages import NixlDescription, NixlHello, NixlInbox
from weightbus.core.transport.nixl.schedule import inbox_entries, inbox_slot_bytes
from weightbus.core.transport.parts.arena import DirectPlacement
from weightbus.core.transport.parts.rank_session import RankSessionSource
from weightbus.core.wire import (
    DirectReady,
    ProtocolError,
    TensorsWritten,
    UpdateBegin,
)

NO_MEMORY = (
    "transport nixl writes into the parameters' shared-memory arena, and this rank has none "
    "(engine started with --no-shm-weights, or /dev/shm could not hold them)"
)
# Inbox slots: the publisher writes bucket k+1 into one while the Receiver loads bucket k.
INBOX_SLOTS = 2


class _Inbox:
    """One registered inbox buffer of an agent; `busy` while a session uses it."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.memory: torch.Tensor | None = None
        self.busy = False


# Inboxes by agent name, kept across sessions (registering memory changes the agent's
# metadata, which the publisher then loads again); a second concurrent session gets its own.
_inboxes: dict[str, list[_Inbox]] = {}
_inboxes_lock = threading.Lock()
# Whole tensors larger than a bucket are reassembled into buffers kept across pushes.
_assembly_buffers: dict[tuple, torch.Tensor] = {}


def _acquire_inbox(agent: Agent, nbytes: int) -> _Inbox:
    """A free inbox of `agent` of at least `nbytes`, registered, marked busy."""
    with _inboxes_lock:
        pool = _inboxes.setdefault(agent.name, [])
        inbox = next((each for each in pool if not each.busy), None)
        if inbox is None:
            inbox = _Inbox(f"weightbus-inbox-{len(pool)}")
            pool.append(inbox)
        inbox.busy = True
    try:
        if inbox.memory is None or inbox.memory.numel() < nbytes:
            agent.forget(inbox.key)
            inbox.memory = None
            memory = torch.empty(nbytes, dtype=torch.uint8)
            agent.register(inbox.key, memory)
            inbox.memory = memory
    except BaseException:
        _release_inbox(inbox)
        raise
    return inbox


def _no_ack() -> None:
    """The release of a batch with nothing in the inbox: no slot to hand back."""


def _release_inbox(inbox: _Inbox) -> None:
    with _inboxes_lock:
        inbox.busy = False


class NixlSource(RankSessionSource):
    """Engine-rank side of `nixl` for one session.

    Args:
        direct: this rank's parameters in a shared-memory arena (live, or staging for an
            atomic update): registered with the rank's NIXL agent and offered for writes.
    """

    def __init__(
        self,
        description: NixlDescription,
        *,
        rank: int = 0,
        tp_size: int = 1,
        direct: DirectPlacement | None = None,
    ) -> None:
        refusal = f"nixl endpoint {description.endpoint!r}"
        super().__init__(description, rank=rank, tp_size=tp_size, direct=direct, refusal=refusal)
        self._publisher_host = description.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        self._agent: Agent | None = None
        self._plan: Plan | None = None
        self._whole: list[list[BucketEntry]] = []  # per bucket: its entries for the inbox
        self._inbox: _Inbox | None = None
        self._inbox_memory: torch.Tensor | None = None  # held while the session reads it
        self._slot_bytes = 0

    def _hello(self) -> NixlHello:
        agent = self._agent = rank_agent(self.rank, self._publisher_host)
        placement = self._placement
        fields = {
            "session_id": self.session_id,
            "group": self.group,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "agent_name": agent.name,
        }
        if placement is None or placement.memory is None:
            return NixlHello(**fields, agent_metadata=agent.metadata(), refusal=NO_MEMORY)
        agent.register(placement.target.file, placement.memory)
        return NixlHello(
            **fields,
            agent_metadata=agent.metadata(),
            memory_address=placement.memory.data_ptr(),
            target=placement.target,
        )

    def begin(self, timeout_s: float) -> UpdateBegin:
        hello = self._hello()
        self._socket.send(hello.encode())
        if hello.target is None:
            raise ValueError(NO_MEMORY)
        header = self._recv(UpdateBegin, timeout_s)
        if not header.direct:
            raise ProtocolError("a nixl session must write into the ranks' parameters")
        self._plan = plan_buckets([meta.to_meta() for meta in header.tensors], header.bucket_bytes)
        held = {copy.hf_name for copy in hello.target.copies}
        self._whole = [inbox_entries(bucket, held) for bucket in self._plan.buckets]
        self._offer_inbox(inbox_slot_bytes(self._whole))
        # sent before begin() returns: the Receiver marks the target touched right after
        ready = DirectReady(session_id=self.session_id, group=self.group, rank=self.rank)
        self._socket.send(ready.encode())
        return header

    def _offer_inbox(self, slot_bytes: int) -> None:
        """Tell the publisher where this session's whole tensors land (before `DirectReady`,
        on the same socket: it has the inbox once it has every rank's confirmation)."""
        if not slot_bytes:
            return
        assert self._agent is not None
        self._inbox = _acquire_inbox(self._agent, INBOX_SLOTS * slot_bytes)
        self._slot_bytes = slot_bytes
        self._inbox_memory = self._inbox.memory
        assert self._inbox_memory is not None
        offer = NixlInbox(
            session_id=self.session_id,
            group=self.group,
            rank=self.rank,
            address=self._inbox_memory.data_ptr(),
            slot_bytes=slot_bytes,
            slots=INBOX_SLOTS,
            agent_metadata=self._agent.metadata(),
        )
        self._socket.send(offer.encode())

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        """One batch per plan bucket: the tensors written into this rank's parameters
        (`placed`, with the digests of its slices) and those written whole into its inbox
        (`tensors`: views valid until the batch's `release`).

        A batch's `nbytes` are the bytes of this rank's slices of the tensors it completes (a
        tensor split across buckets counts once, in the bucket of its last byte) and the bytes
        of the bucket written into its inbox."""
        assert self._plan is not None, "begin() first"
        assert self._placement is not None
        regions = self._placement.regions
        deadline = time.monotonic() + timeout_s
        assembler = ChunkAssembler(buffers=_assembly_buffers)
        for bucket in self._plan.buckets:
            written = self._recv(TensorsWritten, deadline - time.monotonic())
            names = bucket.finished_names()
            if written.bucket_index != bucket.index or set(written.digests) != set(names):
                raise ValueError(f"written tensors of bucket {bucket.index} do not match the plan")
            whole = self._whole[bucket.index]
            tensors = []
            if whole:
                slot = self._slot(bucket.index)
                tensors = list(
                    unpack_bucket(BucketPlan(bucket.index, tuple(whole)), slot, assembler)
                )
            received = {entry.name for entry in whole}
            placed = [(name, regions.get(name)) for name in names if name not in received]
            yield ReceivedBatch(
                tensors=tensors,
                digests=dict(written.digests),
                nbytes=sum(region.nbytes for _, region in placed if region is not None)
                + sum(entry.nbytes for entry in whole),
                placed=placed,
                placed_digests=dict(written.slice_digests),
                release=self._acker(bucket.index, bucket.index % INBOX_SLOTS) if whole else _no_ack,
            )

    def _slot(self, bucket_index: int) -> torch.Tensor:
        assert self._inbox_memory is not None
        start = (bucket_index % INBOX_SLOTS) * self._slot_bytes
        return self._inbox_memory[start : start + self._slot_bytes]

    def close(self) -> None:
        super().close()
        if self._inbox is not None:
            _release_inbox(self._inbox)
            self._inbox = None
